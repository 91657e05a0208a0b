"""Report rows -> text: a rich table, CSV, JSON, or one self-contained HTML page.

Renderers take the plain rows of ``reports.summary`` and do no aggregation. The HTML
page draws its charts as inline SVG: no scripts, no CDN, readable offline.
"""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime
from html import escape

from .reports import GROUP_FIELDS, METRICS

# column -> (header, format) for the table and the HTML page
_COLUMNS = {
    "requests": ("requests", "{:,}"),
    "failed": ("failed", "{:,}"),
    "prompt_tokens": ("prompt tok", "{:,}"),
    "output_tokens": ("output tok", "{:,}"),
    "tokens_per_s_mean": ("tok/s mean", "{:.1f}"),
    "tokens_per_s_p50": ("tok/s p50", "{:.1f}"),
    "tokens_per_s_p95": ("tok/s p95", "{:.1f}"),
    "latency_p50_s": ("latency p50 s", "{:.2f}"),
    "latency_p95_s": ("latency p95 s", "{:.2f}"),
    "ttft_p50_s": ("TTFT p50 s", "{:.3f}"),
    "ttft_p95_s": ("TTFT p95 s", "{:.3f}"),
    "acceptance_rate": ("acceptance", "{:.1%}"),
    "mean_accepted_length": ("accepted len", "{:.2f}"),
    "speedup": ("speedup", "{:.2f}x"),
    "device_seconds": ("device h", "{:.2f}"),  # shown in hours
    "cost_usd": ("cost $", "{:,.2f}"),
    "cost_per_1m_output_tokens": ("$ / 1M out tok", "{:,.2f}"),
}
_TABLE_COLUMNS = ("requests", "failed", "output_tokens", "tokens_per_s_mean", "tokens_per_s_p50",
                  "tokens_per_s_p95", "latency_p50_s", "latency_p95_s", "ttft_p50_s",
                  "acceptance_rate", "mean_accepted_length", "speedup", "device_seconds",
                  "cost_usd", "cost_per_1m_output_tokens")


def _groups(rows: list[dict]) -> list[str]:
    return [k for k in (rows[0] if rows else {}) if k in GROUP_FIELDS]


def fmt(column: str, value) -> str:
    if value is None:
        return "-"
    if column in GROUP_FIELDS:
        return str(value)
    if column == "device_seconds":
        value = value / 3600.0
    return _COLUMNS[column][1].format(value) if column in _COLUMNS else str(value)


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=_groups(rows) + list(METRICS), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2, default=str) + "\n"


def speedup_note(rows: list[dict]) -> str:
    """What the speedup figures are measured against (the bases the rows use)."""
    bases = sorted({r["speedup_basis"] for r in rows if r.get("speedup_basis")})
    return "speedup vs target-only decoding; basis: " + ("; ".join(bases) if bases else "none (no counterfactual recorded)")


def to_table(rows: list[dict], title: str = "specdec-llm report"):
    """A ``rich.table.Table`` (print it with a rich Console)."""
    from rich.table import Table

    table = Table(title=title, caption=speedup_note(rows))
    groups = _groups(rows)
    for g in groups:
        table.add_column(g, no_wrap=True)
    for c in _TABLE_COLUMNS:
        table.add_column(_COLUMNS[c][0], justify="right")
    for r in rows:
        table.add_row(*[fmt(g, r[g]) for g in groups], *[fmt(c, r[c]) for c in _TABLE_COLUMNS])
    return table


def table_text(rows: list[dict], width: int = 220) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(to_table(rows))
    return console.file.getvalue()


# --- HTML -----------------------------------------------------------------------------

_W, _H, _L, _B = 640, 220, 56, 44  # chart width, height, left and bottom margins


def _scale(values: list[float]) -> float:
    top = max([v for v in values if v is not None] or [0.0])
    return top * 1.1 if top > 0 else 1.0


def _svg(title: str, points: list[tuple[str, float | None]], fmt_value, kind: str) -> str:
    """A line or bar chart of (label, value) points as inline SVG."""
    if not points:
        return f'<figure><figcaption>{escape(title)}</figcaption><p class="empty">no data</p></figure>'
    top = _scale([v for _, v in points])
    plot_w, plot_h = _W - _L - 12, _H - _B - 12
    step = plot_w / len(points)

    def y(v: float) -> float:
        return 12 + plot_h * (1 - v / top)

    parts = [f'<line x1="{_L}" y1="{12 + plot_h}" x2="{_W - 12}" y2="{12 + plot_h}" class="axis"/>']
    for frac in (0, 0.5, 1):  # y-axis ticks
        v = top / 1.1 * frac
        parts.append(f'<line x1="{_L}" y1="{y(v):.1f}" x2="{_W - 12}" y2="{y(v):.1f}" class="grid"/>')
        parts.append(f'<text x="{_L - 6}" y="{y(v) + 4:.1f}" class="tick" text-anchor="end">{escape(fmt_value(v))}</text>')
    widest = max(len(str(label)) for label, _ in points) * 6.5 + 12  # px per x label
    every = -(-len(points) // max(1, int(plot_w // widest)))  # labels that fit, evenly spaced
    line = []
    for i, (label, v) in enumerate(points):
        cx = _L + step * (i + 0.5)
        tip = f"<title>{escape(str(label))}: {escape(fmt_value(v) if v is not None else '-')}</title>"
        if v is not None and kind == "bar":
            parts.append(f'<rect x="{cx - step * 0.35:.1f}" y="{y(v):.1f}" width="{step * 0.7:.1f}" '
                         f'height="{12 + plot_h - y(v):.1f}" class="bar">{tip}</rect>')
        elif v is not None:
            line.append(f"{cx:.1f},{y(v):.1f}")
            parts.append(f'<circle cx="{cx:.1f}" cy="{y(v):.1f}" r="3" class="dot">{tip}</circle>')
        if i % every == 0:
            parts.append(f'<text x="{cx:.1f}" y="{_H - _B + 28}" class="tick" text-anchor="middle">{escape(str(label))}</text>')
    if line:
        parts.insert(1, f'<polyline points="{" ".join(line)}" class="line"/>')
    return (f'<figure><figcaption>{escape(title)}</figcaption>'
            f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
            f'aria-label="{escape(title)}">{"".join(parts)}</svg></figure>')


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{padding:4px 8px;border-bottom:1px solid #ddd}
td.n{text-align:right;font-variant-numeric:tabular-nums}th{background:#f4f4f4;text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:1.5em}figure{margin:0}figcaption{font-weight:600}
.axis{stroke:#888}.grid{stroke:#eee}.line{fill:none;stroke:#3367d6;stroke-width:2}.dot{fill:#3367d6}
.bar{fill:#3367d6}.tick{font-size:11px;fill:#555}.empty{color:#888}.meta{color:#666}
"""


def to_html(rows: list[dict], *, timeline: list[dict], by_day: list[dict], by_pair: list[dict],
            filters: dict | None = None) -> str:
    """One self-contained page: the summary table and four charts.

    ``timeline`` is grouped by day or hour alone, ``by_day`` by day and ``by_pair`` by pair.
    """
    groups = _groups(rows)
    columns = [c for c in METRICS if c in _COLUMNS]
    head = "".join(f"<th>{escape(g)}</th>" for g in groups)
    head += "".join(f"<th>{escape(_COLUMNS[c][0])}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(fmt(g, r[g]))}</td>" for g in groups)
        + "".join(f'<td class="n">{escape(fmt(c, r[c]))}</td>' for c in columns) + "</tr>"
        for r in rows
    )
    unit = next((g for g in ("hour", "day") if timeline and g in timeline[0]), "day")
    charts = [
        _svg(f"Acceptance rate by {unit}", [(r[unit], r["acceptance_rate"]) for r in timeline],
             lambda v: f"{v:.0%}", "line"),
        _svg(f"Tokens/s (mean) by {unit}", [(r[unit], r["tokens_per_s_mean"]) for r in timeline],
             lambda v: f"{v:.1f}", "line"),
        _svg("Cost per day (USD)", [(r["day"], r["cost_usd"]) for r in by_day], lambda v: f"{v:,.2f}", "bar"),
        _svg("Speedup over target-only, by pair", [(r["pair"], r["speedup"]) for r in by_pair],
             lambda v: f"{v:.2f}x", "bar"),
    ]
    meta = ", ".join(f"{k}: {v}" for k, v in (filters or {}).items() if v not in (None, (), []))
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>specdec-llm report</title><style>{_CSS}</style></head><body>"
        "<h1>specdec-llm report</h1>"
        f'<p class="meta">Generated {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}. '
        f"{escape(meta or 'All data')}. Times in UTC; {escape(speedup_note(rows))} (each request's "
        "output tokens at the target-only step cost its worker measured at the same batch size).</p>"
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        f'<div class="charts">{"".join(charts)}</div></body></html>\n'
    )


# --- one call: query + render -----------------------------------------------------------

FORMATS = ("table", "csv", "json", "html")


def report(fmt: str = "table", **filters) -> str:
    """Run ``summary`` with these filters and render it as ``fmt`` (see ``FORMATS``).

    "html" adds the chart queries: by day (by hour when the data spans two days or
    less) and by pair.
    """
    return report_rows(fmt, **filters)[0]


def report_rows(fmt: str = "table", *, since=None, until=None, group_by=("pair",), pair=None, job=None,
                price_per_hour=None, url=None) -> tuple[str, int]:
    """``report`` and how many groups it has (0: no data for these filters)."""
    from .reports import ReportInputError, parse_group_by, parse_when, summary

    if fmt not in FORMATS:
        raise ReportInputError(f"--format: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    parse_group_by(group_by)  # bad input fails before any query
    kw = dict(since=parse_when(since, "since"), until=parse_when(until, "until", end=True),
              pair=pair, job=job, price_per_hour=price_per_hour, url=url)
    rows = summary(group_by=group_by, **kw)
    if fmt == "csv":
        return to_csv(rows), len(rows)
    if fmt == "json":
        return to_json(rows), len(rows)
    if fmt == "table":
        return table_text(rows), len(rows)
    by_day = summary(group_by=("day",), **kw)
    timeline = summary(group_by=("hour",), **kw) if len(by_day) <= 2 else by_day
    by_pair = summary(group_by=("pair",), **kw)
    filters = {"since": kw["since"], "until": kw["until"], "group by": ", ".join(parse_group_by(group_by)),
               "pair": pair, "job": job}
    return to_html(rows, timeline=timeline, by_day=by_day, by_pair=by_pair, filters=filters), len(rows)
