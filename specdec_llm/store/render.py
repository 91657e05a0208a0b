"""Report rows -> text: a rich table, CSV, JSON, or one self-contained HTML page.

Renderers take the plain rows of ``reports.summary`` and do no aggregation. The HTML
page draws its charts as inline SVG: no scripts, no CDN, readable offline.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from html import escape
from typing import TYPE_CHECKING, Any

from .reports import GROUP_FIELDS, METRICS, ReportInputError

if TYPE_CHECKING:
    from rich.table import Table

Columns = str | Iterable[str] | None  # metric names: a list and/or comma-separated text (parse_columns)

# column -> (header, format) for the table and the HTML page ("money": see ``_money``)
_COLUMNS = {
    "requests": ("requests", "{:,}"),
    "ok": ("ok", "{:,}"),
    "failed": ("failed", "{:,}"),
    "prompt_tokens": ("prompt tok", "{:,}"),
    "output_tokens": ("output tok", "{:,}"),
    "tokens_per_s_mean": ("tok/s mean", "{:,.1f}"),
    "tokens_per_s_p50": ("tok/s p50", "{:,.1f}"),
    "tokens_per_s_p95": ("tok/s p95", "{:,.1f}"),
    "latency_p50_s": ("latency p50 s", "{:.2f}"),
    "latency_p95_s": ("latency p95 s", "{:.2f}"),
    "ttft_p50_s": ("TTFT p50 s", "{:.3f}"),
    "ttft_p95_s": ("TTFT p95 s", "{:.3f}"),
    "acceptance_rate": ("acceptance", "{:.1%}"),
    "mean_accepted_length": ("accepted len", "{:.2f}"),
    "speedup": ("speedup", "{:.2f}x"),
    "device_seconds": ("device h", "money"),  # shown in hours
    "cost_usd": ("cost $", "money"),
    "cost_per_1m_output_tokens": ("$/1M out tok", "money"),
}
# the table's columns by default, in this order; a narrow terminal folds them into more tables
TABLE_COLUMNS = (
    "requests",
    "failed",
    "output_tokens",
    "tokens_per_s_mean",
    "tokens_per_s_p50",
    "tokens_per_s_p95",
    "latency_p50_s",
    "latency_p95_s",
    "ttft_p50_s",
    "acceptance_rate",
    "mean_accepted_length",
    "speedup",
    "device_seconds",
    "cost_usd",
    "cost_per_1m_output_tokens",
)
# every row's key figures: always in the first table, whatever the width
KEY_COLUMNS = ("requests", "tokens_per_s_mean", "acceptance_rate", "speedup", "cost_usd")


def _groups(rows: list[dict[str, Any]]) -> list[str]:
    return [k for k in (rows[0] if rows else {}) if k in GROUP_FIELDS]


def _money(value: float, decimals: int | None = None) -> str:
    """Two decimals, or enough for two significant digits below 1 (a CPU job's $0.000042 is
    not "0.00"); ``decimals``: these many."""
    if decimals is None:
        decimals = _decimals([value])
    return f"{value:,.{decimals}f}"


def _decimals(values: Iterable[float | None]) -> int:
    """Decimals that show every value in ``values`` with two significant digits (at least 2, at most 8)."""
    small = [abs(v) for v in values if v is not None and 0 < abs(v) < 1]
    return min(8, max([2] + [1 - math.floor(math.log10(v)) for v in small]))


def fmt(column: str, value: Any, decimals: int | None = None) -> str:
    """One cell; ``decimals`` for money columns (``cells`` picks one count per column)."""
    if value is None:
        return "-"
    if column in GROUP_FIELDS:
        return str(value)
    if column == "device_seconds":
        value = value / 3600.0
    if column not in _COLUMNS:
        return str(value)
    spec = _COLUMNS[column][1]
    return _money(value, decimals) if spec == "money" else spec.format(value)


def cells(column: str, rows: list[dict[str, Any]]) -> list[str]:
    """A column's cells, money with the same number of decimals in every row."""
    decimals = None
    if _COLUMNS.get(column, ("", ""))[1] == "money":
        scale = 3600.0 if column == "device_seconds" else 1.0
        decimals = _decimals([r[column] / scale for r in rows if r[column] is not None])
    return [fmt(column, r[column], decimals) for r in rows]


def parse_columns(columns: Columns) -> tuple[str, ...] | None:
    """Metric names from a list and/or comma-separated text ("all": every metric); None or
    empty: the default (``TABLE_COLUMNS``, key figures first when folded)."""
    items = [columns] if isinstance(columns, str) else list(columns or ())
    names: list[str] = []
    for name in (n.strip().lower() for item in items for n in str(item).split(",")):
        if name == "all":
            names += [c for c in METRICS if c not in names]
        elif name and name not in METRICS:
            raise ReportInputError(f"--columns: unknown column {name!r}; use all, or any of {', '.join(METRICS)}")
        elif name and name not in names:
            names.append(name)
    return tuple(names) or None


def to_csv(rows: list[dict[str, Any]], columns: Columns = None) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf,
        fieldnames=_groups(rows) + list(parse_columns(columns) or METRICS),
        lineterminator="\n",
        extrasaction="ignore",
    )
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_json(rows: list[dict[str, Any]], columns: Columns = None) -> str:
    keep = parse_columns(columns)
    if keep:
        rows = [{k: v for k, v in r.items() if k in GROUP_FIELDS or k in keep} for r in rows]
    return json.dumps(rows, indent=2, default=str) + "\n"


def speedup_note(rows: list[dict[str, Any]]) -> str:
    """What the speedup figures are measured against (the bases the rows use), and where a
    cost covers only some of a row's requests (some were recorded without a price)."""
    bases = sorted({r["speedup_basis"] for r in rows if r.get("speedup_basis")})
    note = "speedup vs target-only decoding; basis: " + (
        "; ".join(bases) if bases else "none (no counterfactual recorded)"
    )
    partial = [r for r in rows if r.get("cost_basis")]
    if partial:
        labels = ", ".join(" / ".join(str(r[g]) for g in _groups(rows)) or "all" for r in partial[:5])
        more = f" and {len(partial) - 5} more" if len(partial) > 5 else ""
        note += (
            f"\ncost covers the priced requests only in {labels}{more} (no price for the others' device: "
            "--price-per-hour or SPECDEC_PRICE_PER_HOUR)"
        )
    return note


def _header_width(header: str) -> int:
    return max(len(word) for word in header.split())  # a header wraps at its spaces


def _table(
    rows: list[dict[str, Any]],
    groups: list[str],
    group_widths: list[int],
    columns: Sequence[str],
    title: str,
    wrap: bool = True,
) -> Table:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    for g, w in zip(groups, group_widths):
        table.add_column(g, width=w, overflow="fold")
    values = [cells(c, rows) for c in columns]
    for c, col in zip(columns, values):
        header = _COLUMNS[c][0]
        head = _header_width(header) if wrap else len(header)
        table.add_column(header, justify="right", width=max([head] + [len(v) for v in col]))
    for i, r in enumerate(rows):  # (labels as plain text: a category "[bold]x[/]" is no rich markup)
        table.add_row(*[Text(fmt(g, r[g])) for g in groups], *[col[i] for col in values])
    return table


def to_tables(
    rows: list[dict[str, Any]], width: int = 220, columns: Columns = None, title: str = "specdec-llm report"
) -> list[Table]:
    """``rich.table.Table``s that fit ``width`` columns (print each with a rich Console).

    The first table holds the group labels and every row's key figures (``KEY_COLUMNS``,
    or the first of ``columns``), then as many further columns as fit; the rest fold into
    more tables, each repeating the group labels. Headers wrap at their spaces; numbers
    are never cut. ``columns``: metric names (see ``parse_columns``), default ``TABLE_COLUMNS``.
    """
    from rich.console import Console

    console = Console(width=10**4)
    chosen = parse_columns(columns)
    order = [c for c in chosen or TABLE_COLUMNS if c in _COLUMNS]  # (speedup_basis: in the note under the tables)
    groups = _groups(rows)
    natural = [max([len(g)] + [len(fmt(g, r[g])) for r in rows]) for g in groups]
    one = _table(rows, groups, natural, order, title, wrap=False)
    if console.measure(one).maximum <= width:  # all of it, headers on one line
        return [one]
    first = [c for c in (KEY_COLUMNS if chosen is None else chosen[:1]) if c in order]

    def fits(cols: Sequence[str], gw: list[int] | None = None) -> bool:
        return console.measure(_table(rows, groups, gw or natural, cols, title)).maximum <= width

    # the group labels give way (they fold onto more lines) before the key figures do
    group_widths = list(natural)
    while group_widths and not fits(first, group_widths) and max(group_widths) > 8:
        group_widths[group_widths.index(max(group_widths))] -= 1
    tables: list[list[str]] = []
    current = list(first)
    for c in (c for c in order if c not in first):
        if fits(sorted(current + [c], key=order.index), group_widths):
            current.append(c)
        else:
            tables.append(current)
            current = [c]
    tables.append(current)
    return [
        _table(
            rows,
            groups,
            group_widths,
            sorted(cols, key=order.index),
            title if len(tables) == 1 else f"{title} ({i + 1}/{len(tables)})",
        )
        for i, cols in enumerate(tables)
    ]


def to_table(rows: list[dict[str, Any]], title: str = "specdec-llm report", columns: Columns = None) -> Table:
    """One ``rich.table.Table`` with every column (wide terminals; see ``to_tables``)."""
    return to_tables(rows, 10**4, columns, title)[0]


def table_text(rows: list[dict[str, Any]], width: int = 220, columns: Columns = None) -> str:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    for table in to_tables(rows, width, columns):
        console.print(table)
    console.print(speedup_note(rows), markup=False, highlight=False)
    return out.getvalue()


# --- HTML -----------------------------------------------------------------------------

_W, _H, _L, _B = 640, 220, 56, 44  # chart width, height, left and bottom margins


def _ticks(top: float, n: int = 4) -> tuple[list[float], float]:
    """Round y-axis ticks from 0 to at least ``top``, about ``n`` steps of 1, 2 or 5 x 10^k,
    and that step."""
    top = top if top > 0 else 1.0
    magnitude = 10 ** math.floor(math.log10(top / n))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= top / n * (1 - 1e-9))
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)], step


# chart value kinds: (format of an axis label with d decimals, format of a value in a tooltip)
_KINDS: dict[str, tuple[Callable[[float, int], str], Callable[[float], str]]] = {
    "percent": (lambda v, d: f"{v * 100:.{max(0, d - 2)}f}%", lambda v: f"{v:.1%}"),
    "number": (lambda v, d: f"{v:,.{d}f}", lambda v: f"{v:,.1f}"),
    "usd": (lambda v, d: f"${v:,.{d}f}", lambda v: f"${_money(v)}"),
    "times": (lambda v, d: f"{v:.{d}f}x", lambda v: f"{v:.2f}x"),
}


def _svg(title: str, points: list[tuple[str, float | None]], kind: str, shape: str) -> str:
    """A line or bar chart of (label, value) points as inline SVG. ``kind``: one of ``_KINDS``
    (percent charts span 0-100%); ``shape``: "line" or "bar"."""
    if not points:
        return f'<figure><figcaption>{escape(title)}</figcaption><p class="empty">no data</p></figure>'
    label_fmt, value_fmt = _KINDS[kind]
    top = max([v for _, v in points if v is not None] or [0.0])
    ticks, tick_step = _ticks(max(top, 1.0) if kind == "percent" else top)
    decimals = max(0, -math.floor(math.log10(tick_step) + 1e-9))
    plot_w, plot_h = _W - _L - 12, _H - _B - 12
    step = plot_w / len(points)

    def y(v: float) -> float:
        return 12 + plot_h * (1 - v / ticks[-1])

    parts = [f'<line x1="{_L}" y1="{12 + plot_h}" x2="{_W - 12}" y2="{12 + plot_h}" class="axis"/>']
    for t in ticks:  # y-axis ticks
        parts.append(f'<line x1="{_L}" y1="{y(t):.1f}" x2="{_W - 12}" y2="{y(t):.1f}" class="grid"/>')
        parts.append(
            f'<text x="{_L - 6}" y="{y(t) + 4:.1f}" class="tick y" text-anchor="end">'
            f"{escape(label_fmt(t, decimals))}</text>"
        )
    widest = max(len(str(label)) for label, _ in points) * 6.5 + 12  # px per x label
    every = -(-len(points) // max(1, int(plot_w // widest)))  # labels that fit, evenly spaced
    line = []
    for i, (label, v) in enumerate(points):
        cx = _L + step * (i + 0.5)
        tip = f"<title>{escape(str(label))}: {escape(value_fmt(v) if v is not None else '-')}</title>"
        if v is not None and shape == "bar":
            parts.append(
                f'<rect x="{cx - step * 0.35:.1f}" y="{y(v):.1f}" width="{step * 0.7:.1f}" '
                f'height="{12 + plot_h - y(v):.1f}" class="bar">{tip}</rect>'
            )
        elif v is not None:
            line.append(f"{cx:.1f},{y(v):.1f}")
            parts.append(f'<circle cx="{cx:.1f}" cy="{y(v):.1f}" r="3" class="dot">{tip}</circle>')
        if i % every == 0:
            parts.append(
                f'<text x="{cx:.1f}" y="{_H - _B + 28}" class="tick x" text-anchor="middle">{escape(str(label))}</text>'
            )
    if line:
        parts.insert(1, f'<polyline points="{" ".join(line)}" class="line"/>')
    return (
        f"<figure><figcaption>{escape(title)}</figcaption>"
        f'<svg viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
        f'aria-label="{escape(title)}">{"".join(parts)}</svg></figure>'
    )


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
.wide{overflow-x:auto;margin:1em 0}table{border-collapse:collapse}
th,td{padding:4px 8px;border-bottom:1px solid #ddd}th{background:#f4f4f4;text-align:left;vertical-align:bottom}
.n{text-align:right;font-variant-numeric:tabular-nums}td.g{white-space:nowrap}
caption{text-align:left;font-weight:600;padding:0 0 4px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(420px,1fr));gap:1.5em;max-width:1320px}
figure{margin:0}figcaption{font-weight:600}svg{width:100%;height:auto}
.axis{stroke:#888}.grid{stroke:#eee}.line{fill:none;stroke:#3367d6;stroke-width:2}.dot{fill:#3367d6}
.bar{fill:#3367d6}.tick{font-size:11px;fill:#555}.empty{color:#888}.meta{color:#666}
"""


def _html_table(rows: list[dict[str, Any]], columns: Iterable[str], caption: str = "") -> str:
    groups = _groups(rows)
    columns = [c for c in columns if c in _COLUMNS]
    head = "".join(f"<th>{escape(g)}</th>" for g in groups)
    head += "".join(f'<th class="n">{escape(_COLUMNS[c][0])}</th>' for c in columns)
    values = [cells(c, rows) for c in columns]
    body = "".join(
        "<tr>"
        + "".join(f'<td class="g">{escape(fmt(g, r[g]))}</td>' for g in groups)
        + "".join(f'<td class="n">{escape(col[i])}</td>' for col in values)
        + "</tr>"
        for i, r in enumerate(rows)
    )
    caption = f"<caption>{escape(caption)}</caption>" if caption else ""
    return f'<div class="wide"><table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def to_html(
    rows: list[dict[str, Any]],
    *,
    timeline: list[dict[str, Any]],
    by_day: list[dict[str, Any]],
    by_pair: list[dict[str, Any]],
    filters: dict[str, Any] | None = None,
    columns: Columns = None,
) -> str:
    """One self-contained page: the summary tables and four charts.

    ``timeline`` is grouped by day or hour alone, ``by_day`` by day and ``by_pair`` by pair.
    ``columns``: one table of these metrics (see ``parse_columns``); default: every row's key
    figures (``KEY_COLUMNS``) in a table that fits any screen, then a table of all the rest.
    """
    chosen = parse_columns(columns)
    tables = [chosen] if chosen else [KEY_COLUMNS, [c for c in METRICS if c in _COLUMNS and c not in KEY_COLUMNS]]
    captions = [""] if chosen else ["Key figures", "More figures"]
    html_tables = "".join(_html_table(rows, cols, caption) for cols, caption in zip(tables, captions))
    unit = next((g for g in ("hour", "day") if timeline and g in timeline[0]), "day")
    charts = [
        _svg(f"Acceptance rate by {unit}", [(r[unit], r["acceptance_rate"]) for r in timeline], "percent", "line"),
        _svg(f"Tokens/s (mean) by {unit}", [(r[unit], r["tokens_per_s_mean"]) for r in timeline], "number", "line"),
        _svg("Cost per day (USD)", [(r["day"], r["cost_usd"]) for r in by_day], "usd", "bar"),
        _svg("Speedup over target-only, by pair", [(r["pair"], r["speedup"]) for r in by_pair], "times", "bar"),
    ]
    meta = ", ".join(f"{k}: {v}" for k, v in (filters or {}).items() if v not in (None, (), []))
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>specdec-llm report</title><style>{_CSS}</style></head><body>"
        "<h1>specdec-llm report</h1>"
        f'<p class="meta">Generated {datetime.now().astimezone():%Y-%m-%d %H:%M %Z}. '
        f"{escape(meta or 'All data')}. Times in UTC; {escape(speedup_note(rows))} (each request's "
        "output tokens at the target-only step cost its worker measured at the same batch size).</p>"
        f"{html_tables}"
        f'<div class="charts">{"".join(charts)}</div></body></html>\n'
    )


# --- one call: query + render -----------------------------------------------------------

FORMATS = ("table", "csv", "json", "html")


def report(fmt: str = "table", **filters: Any) -> str:
    """Run ``summary`` with these filters and render it as ``fmt`` (see ``FORMATS``).

    "html" adds the chart queries: by day (by hour when the data spans two days or
    less) and by pair.
    """
    return report_rows(fmt, **filters)[0]


def report_rows(
    fmt: str = "table",
    *,
    since: object = None,
    until: object = None,
    group_by: Iterable[str] | str | None = ("pair",),
    pair: str | None = None,
    job: str | None = None,
    price_per_hour: Any = None,
    url: str | None = None,
    columns: Columns = None,
    width: int = 220,
) -> tuple[str, int]:
    """``report`` and how many groups it has (0: no data for these filters). ``columns``:
    which metrics (see ``parse_columns``); ``width``: the table's, in characters."""
    from .reports import ReportInputError, parse_group_by, parse_when, summary

    if fmt not in FORMATS:
        raise ReportInputError(f"--format: unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    parse_group_by(group_by)  # bad input fails before any query
    parse_columns(columns)
    kw: dict[str, Any] = dict(
        since=parse_when(since, "since"),
        until=parse_when(until, "until", end=True),
        pair=pair,
        job=job,
        price_per_hour=price_per_hour,
        url=url,
    )
    rows = summary(group_by=group_by, **kw)
    if fmt == "csv":
        return to_csv(rows, columns), len(rows)
    if fmt == "json":
        return to_json(rows, columns), len(rows)
    if fmt == "table":
        return table_text(rows, width, columns), len(rows)
    by_day = summary(group_by=("day",), **kw)
    timeline = summary(group_by=("hour",), **kw) if len(by_day) <= 2 else by_day
    by_pair = summary(group_by=("pair",), **kw)
    filters = {
        "since": kw["since"],
        "until": kw["until"],
        "group by": ", ".join(parse_group_by(group_by)),
        "pair": pair,
        "job": job,
    }
    return to_html(rows, timeline=timeline, by_day=by_day, by_pair=by_pair, filters=filters, columns=columns), len(rows)
