"""Reports over the store: one SQL aggregate per report, rows out as plain dicts.

``summary()`` groups successful requests' telemetry (and counts failed requests) by any
of ``GROUP_FIELDS`` and returns, per group: request counts, tokens, tokens/s (mean, p50,
p95), latency and time-to-first-token percentiles, acceptance, measured speedup over
target-only decoding (and its basis, ``speedup_basis``), device time and cost.

Speedup: the group's summed target-only counterfactual seconds over its summed wall
seconds. Each request's counterfactual (``telemetry.baseline_s``, engine Stats) is measured
like for like by the process that ran it: its output tokens at the target-only step cost
that process measured at the same batch size (``SPEEDUP_BASIS``). Rows recorded before
that column existed fall back to their tokens/s over the pair's start-up calibration
baseline (``LEGACY_BASIS``), only in a group with no newer row. All aggregation, percentiles included, runs
in the database: ``percentile_cont`` on PostgreSQL, the ``specdec_percentiles`` aggregate
(registered on each connection, see ``db.py``) on SQLite. All times are UTC.

A report only reads: it never creates or upgrades the database.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Float,
    Select,
    SQLColumnExpression,
    String,
    and_,
    case,
    cast,
    func,
    literal,
    literal_column,
    select,
)

from ..settings import get_settings
from .db import StoreError, check_schema, resolve_url, session_scope
from .models import Baseline, Pair, Request, Telemetry, Worker, utcnow

GROUP_FIELDS = ("pair", "day", "hour", "job", "worker", "category", "drafter")
METRICS = (
    "requests",
    "ok",
    "failed",
    "prompt_tokens",
    "output_tokens",
    "tokens_per_s_mean",
    "tokens_per_s_p50",
    "tokens_per_s_p95",
    "latency_p50_s",
    "latency_p95_s",
    "ttft_p50_s",
    "ttft_p95_s",
    "acceptance_rate",
    "mean_accepted_length",
    "speedup",
    "speedup_basis",
    "device_seconds",
    "cost_usd",
    "cost_per_1m_output_tokens",
    "cost_basis",
)
# percentile columns: name in the row -> telemetry column
_PERCENTILES = {
    "tokens_per_s": Telemetry.tokens_per_s,
    "latency": Telemetry.wall_time_s,
    "ttft": Telemetry.time_to_first_token_s,
}


SPEEDUP_BASIS = "same-process target-only step cost at the same batch size"  # = engine.SPEEDUP_BASIS
LEGACY_BASIS = "start-up calibration run (legacy rows)"


class ReportInputError(StoreError, ValueError):
    """Bad report input (group-by field, date, price); the message says the fix."""


# --- input ----------------------------------------------------------------------------


def parse_group_by(group_by: Iterable[str] | str | None) -> tuple[str, ...]:
    """("pair", "day") from a list and/or comma-separated names; () means one total row."""
    if group_by is None:
        return ()
    items = [group_by] if isinstance(group_by, str) else list(group_by)
    fields: list[str] = []
    for item in items:
        for name in str(item).split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name not in GROUP_FIELDS:
                raise ReportInputError(
                    f"--group-by: unknown field {name!r}; use one or more of {', '.join(GROUP_FIELDS)}"
                )
            if name not in fields:
                fields.append(name)
    return tuple(fields)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_when(
    value: object, option: str = "since", *, end: bool = False, now: datetime | None = None
) -> datetime | None:
    """A report bound as naive UTC: None, a datetime/date, or text: a duration back from
    now ("7d", "12h", "30m", "2w") or an ISO date/time ("2026-01-31", "2026-01-31T12:00",
    with an offset or Z if not UTC). A bare date as ``end`` means the end of that day."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        text = value.strip()
        m = _DURATION.match(text.lower())
        if m:
            try:
                return (now or utcnow()) - timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})
            except OverflowError:  # before year 1
                raise ReportInputError(
                    f"--{option}: {value!r} reaches back before the year 1; use a shorter duration or a date "
                    "like 2026-01-31"
                ) from None
        try:
            value = _iso_date(text) or datetime.fromisoformat(text)
        except ValueError:
            raise ReportInputError(
                f"--{option}: cannot read {value!r}; use a duration like 7d, 12h or 30m, "
                "or a UTC date/time like 2026-01-31 or 2026-01-31T12:00"
            ) from None
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day) + timedelta(days=1 if end else 0)
    raise ReportInputError(f"--{option}: expected a date, a datetime or text, not {type(value).__name__}")


def _iso_date(text: str) -> date | None:
    """A bare ISO date ("2026-01-31", "20260131"), or None for anything else."""
    try:
        return date.fromisoformat(text)
    except ValueError:
        return None


DEVICE_KINDS = ("cpu", "cuda", "mps", "xpu", "*")  # what a price may name (torch's device types)


def parse_prices(value: Any, option: str = "--price-per-hour") -> dict[str, float] | None:
    """USD per device-hour by device kind: 2.5 (every kind), {"cuda": 2.5, "cpu": 0.1,
    "*": 1.0} ("*" = any other kind), or text such as "2.5", "cuda=2.5,cpu=0.1" (as in
    SPECDEC_PRICE_PER_HOUR) or ["cuda=2.5", "cpu=0.1"] (a repeated CLI option; each item
    may hold commas too). The one price parser: reports, workers and LangChain use it.
    A comma separates kinds, never decimals: "1,5" is refused, not read as 5. ``option``
    names where the value came from in the errors."""
    if value is None or value == [] or value == () or value == "":
        return None
    if isinstance(value, (int, float, str)):
        value = [value]
    if not isinstance(value, Mapping):
        value = [part for v in value for part in (_split_prices(v, option) if isinstance(v, str) else [v])]
    items = value.items() if isinstance(value, Mapping) else (_price_item(v, option) for v in value)
    prices: dict[str, float] = {}
    for kind, price in items:
        try:
            price = float(price)
        except (TypeError, ValueError):
            price = -1.0
        if not price >= 0 or price == float("inf"):
            raise ReportInputError(f"{option}: {kind}={price!r} is not a price; use USD per device-hour >= 0")
        kind = str(kind).strip().lower() or "*"
        if kind not in DEVICE_KINDS:  # (a price no device would ever get: gpu=3 priced nothing)
            raise ReportInputError(
                f"{option}: {kind}={price:g}: {kind!r} is not a device kind; use {', '.join(DEVICE_KINDS)} (* = any other)"
            )
        if kind in prices:
            raise ReportInputError(
                f"{option}: {'a price for every device' if kind == '*' else kind} is given twice; "
                "give each device kind once, e.g. 2.5 or cuda=2.5,cpu=0.05"
            )
        prices[kind] = price
    return prices


def price_for(value: Any, device: str) -> float | None:
    """USD per device-hour for ``device`` ("cuda:0" -> its kind's price, else "*") from a
    price in any form ``parse_prices`` reads (None: the ``SPECDEC_PRICE_PER_HOUR`` setting);
    None when none applies. Workers and LangChain's local mode price their rows with it."""
    from .record import device_kind

    option = "--price-per-hour"
    if value is None:
        value, option = get_settings().price_per_hour, "SPECDEC_PRICE_PER_HOUR"
    prices = parse_prices(value, option) or {}
    return prices.get(device_kind(device), prices.get("*"))


def _split_prices(text: str, option: str) -> list[str]:
    parts = [part for part in text.split(",") if part.strip()]
    if len(parts) > 1 and not all("=" in part for part in parts):  # "1,5": a decimal comma, not two prices
        raise ReportInputError(
            f"{option}: cannot read {text!r}: a comma separates device kinds, not decimals; "
            "use a dot decimal (1.5) or the cuda=2.5,cpu=0.05 form"
        )
    return parts


def _price_item(v: object, option: str) -> tuple[str, float]:
    if isinstance(v, (int, float)):
        return "*", v
    kind, sep, price = str(v).partition("=")
    if not sep:
        kind, price = "*", kind
    try:
        return kind, float(price)
    except ValueError:
        raise ReportInputError(
            f"{option}: cannot read {v!r}; use USD per device-hour, e.g. 2.5 or cuda=2.5,cpu=0.05"
        ) from None


# --- SQL ------------------------------------------------------------------------------


def _time_bucket(dialect: str, column: Any, unit: str) -> ColumnElement[str]:
    # constants are inlined (literal_column) so SELECT and GROUP BY render identically
    if dialect == "postgresql":
        fmt = "'YYYY-MM-DD'" if unit == "day" else "'YYYY-MM-DD HH24:00'"
        return func.to_char(column, literal_column(fmt), type_=String)
    # SQLite stores "YYYY-MM-DD HH:MM:SS.ffffff"
    if unit == "day":
        return func.substr(column, literal_column("1"), literal_column("10"), type_=String)
    return func.substr(column, literal_column("1"), literal_column("13"), type_=String).concat(literal_column("':00'"))


def _keys(model: type[Telemetry] | type[Request], dialect: str, groups: tuple[str, ...]) -> list[Any]:
    exprs = {
        "pair": model.pair_id,
        "job": model.job_id,
        "worker": model.worker_id,
        "category": model.category,
        # a request's main drafter (most tokens proposed); a failed request has none
        "drafter": Telemetry.drafter if model is Telemetry else func.nullif(Request.status, Request.status),
        "day": _time_bucket(dialect, model.finished_at, "day"),
        "hour": _time_bucket(dialect, model.finished_at, "hour"),
    }
    return [exprs[g].label(g) for g in groups]


def _filters(
    model: type[Telemetry] | type[Request],
    since: datetime | None,
    until: datetime | None,
    pair: str | None,
    job: str | None,
) -> list[Any]:
    where: list[Any] = []
    if since is not None:
        where.append(model.finished_at >= since)
    if until is not None:
        where.append(model.finished_at < until)
    if pair is not None:
        where.append(model.pair_id == select(Pair.id).where(Pair.name == pair).scalar_subquery())
    if job is not None:
        where.append(model.job_id == job)
    return where


def _device_seconds() -> ColumnElement[Any]:
    """A telemetry row's share of its device's time in SQL: its wall time over the rows it
    decoded beside (``batch_rows``, the mean batch size; 1 where not recorded): 4 rows decoded
    together for 10 s are 10 device-seconds, not 40."""
    T = Telemetry
    return T.wall_time_s / func.coalesce(func.nullif(T.batch_rows, 0), 1.0)


def _row_cost(prices: dict[str, float] | None) -> SQLColumnExpression[Any]:
    """Cost of one telemetry row in SQL: its device-seconds (``_device_seconds``) x price of
    its device kind, else the cost estimated when it was recorded."""
    T = Telemetry
    if not prices:
        return T.estimated_cost_usd
    default = prices.get("*")
    per_kind = {k: v for k, v in prices.items() if k != "*"}
    price: ColumnElement[Any]
    if per_kind:  # no default: other kinds get NULL here, so their recorded estimate
        price = case(per_kind, value=T.device_kind, else_=None if default is None else literal(default, Float))
    else:
        price = literal(default, Float)
    return func.coalesce(_device_seconds() * price / 3600.0, T.estimated_cost_usd)


def _percentile_columns(dialect: str) -> list[Any]:
    if dialect == "postgresql":
        return [
            func.percentile_cont(q).within_group(col).label(f"{name}_p{round(q * 100)}")
            for name, col in _PERCENTILES.items()
            for q in (0.5, 0.95)
        ]
    if dialect == "sqlite":
        return [func.specdec_percentiles(*_PERCENTILES.values(), type_=String).label("percentiles")]
    raise StoreError(f"reports need PostgreSQL or SQLite, not {dialect}")


def _telemetry_query(
    dialect: str, groups: tuple[str, ...], where: list[Any], prices: dict[str, float] | None
) -> Select[Any]:
    T, B = Telemetry, Baseline
    keys = _keys(T, dialect, groups)
    cost = _row_cost(prices)  # (None where a row has no price: the priced rows' count and tokens)
    return (
        select(
            *keys,
            func.count().label("ok"),
            func.sum(T.prompt_tokens).label("prompt_tokens"),
            func.sum(T.output_tokens).label("output_tokens"),
            func.avg(T.tokens_per_s).label("tokens_per_s_mean"),
            *_percentile_columns(dialect),
            (cast(func.sum(T.draft_tokens_accepted), Float) / func.nullif(func.sum(T.draft_tokens_proposed), 0)).label(
                "acceptance_rate"
            ),
            # tokens per target forward over the group: its tokens over its forwards (a request's
            # forwards: its tokens over its own mean), not a mean of the requests' ratios
            (
                cast(func.sum(case((T.mean_accepted_length > 0, T.output_tokens))), Float)
                / func.nullif(func.sum(T.output_tokens / func.nullif(T.mean_accepted_length, 0)), 0)
            ).label("mean_accepted_length"),
            (func.sum(T.baseline_s) / func.nullif(func.sum(case((T.baseline_s.isnot(None), T.wall_time_s))), 0)).label(
                "speedup"
            ),
            func.avg(case((T.baseline_s.is_(None), T.tokens_per_s / func.nullif(B.tokens_per_s, 0)))).label(
                "speedup_legacy"
            ),
            func.sum(_device_seconds()).label("device_seconds"),
            func.sum(cost).label("cost_usd"),
            func.sum(case((cost.is_not(None), 1), else_=0)).label("priced"),
            func.sum(case((cost.is_not(None), T.output_tokens), else_=0)).label("priced_output_tokens"),
        )
        .select_from(T)
        .outerjoin(B, and_(B.pair_id == T.pair_id, B.device_kind == T.device_kind, B.dtype == T.dtype))
        .where(*where)
        .group_by(*[k.element for k in keys])
    )


def _failures_query(dialect: str, groups: tuple[str, ...], where: list[Any]) -> Select[Any]:
    R = Request
    keys = _keys(R, dialect, groups)
    return (
        select(*keys, func.count().label("failed"))
        .where(R.status == "failed", *where)
        .group_by(*[k.element for k in keys])
    )


# --- the report -------------------------------------------------------------------------


def summary(
    since: object = None,
    until: object = None,
    group_by: Iterable[str] | str | None = ("pair",),
    pair: str | None = None,
    job: str | None = None,
    price_per_hour: Any = None,
    url: str | None = None,
) -> list[dict[str, Any]]:
    """Aggregate telemetry per group; one dict per group, group fields first, then ``METRICS``.

    ``since``/``until``: see ``parse_when`` (since inclusive, until exclusive).
    ``price_per_hour``: see ``parse_prices``; without it, the costs estimated at record
    time are summed. Group labels: pair name, job id, worker "host:pid", category,
    drafter (the one that proposed most of a request's draft tokens, "none" for plain
    decoding), day "YYYY-MM-DD", hour "YYYY-MM-DD HH:00"; None where unknown.
    Raises ``ReportInputError`` for bad input and ``StoreError`` for an unusable database,
    before touching anything.
    """
    groups = parse_group_by(group_by)
    since_dt = parse_when(since, "since")
    until_dt = parse_when(until, "until", end=True)
    if since_dt and until_dt and since_dt >= until_dt:
        raise ReportInputError(
            f"--since ({since_dt:%Y-%m-%d %H:%M}) must be before --until ({until_dt:%Y-%m-%d %H:%M})"
        )
    option = "--price-per-hour"
    if price_per_hour is None:
        price_per_hour, option = get_settings().price_per_hour, "SPECDEC_PRICE_PER_HOUR"
    prices = parse_prices(price_per_hour, option)
    url = resolve_url(url)
    check_schema(url)
    with session_scope(url) as s:
        dialect = s.get_bind().dialect.name
        if dialect == "postgresql":  # room for the percentile sorts, this transaction only
            s.execute(select(func.set_config("work_mem", "256MB", True)))
        where_ok = _filters(Telemetry, since_dt, until_dt, pair, job)
        where_failed = _filters(Request, since_dt, until_dt, pair, job)
        ok = s.execute(_telemetry_query(dialect, groups, where_ok, prices)).mappings().all()
        failed = s.execute(_failures_query(dialect, groups, where_failed)).all()
        pair_names = dict(s.execute(select(Pair.id, Pair.name)).all())
        workers = {i: f"{host}:{pid}" for i, host, pid in s.execute(select(Worker.id, Worker.host, Worker.pid))}
    # merge the two result sets by group (a group may have only failures)
    failed_by_key = {tuple(r[: len(groups)]): r[-1] for r in failed}
    rows = [_finish(dict(r), groups, failed_by_key.pop(tuple(r[g] for g in groups), 0)) for r in ok]
    rows += [_finish(dict(zip(groups, key)), groups, n) for key, n in failed_by_key.items()]
    rows = [r for r in rows if r["requests"]]  # (ungrouped, an aggregate over no rows is one row of zeros)
    for r in rows:
        if "pair" in r:
            r["pair"] = pair_names.get(r["pair"], r["pair"])
        if "worker" in r:
            r["worker"] = workers.get(r["worker"], r["worker"])
    rows.sort(key=lambda r: tuple((r[g] is None, str(r[g])) for g in groups))
    return rows


def _finish(raw: dict[str, Any], groups: tuple[str, ...], failed: int) -> dict[str, Any]:
    """Raw SQL row -> report row: labels, typed numbers, derived ratios."""
    row = {g: raw.get(g) for g in groups}
    ok = int(raw.get("ok") or 0)
    row.update(requests=ok + failed, ok=ok, failed=failed)
    for name in ("prompt_tokens", "output_tokens"):
        row[name] = int(raw.get(name) or 0)
    if "percentiles" in raw:  # SQLite: one JSON cell [[p50, p95], ...]
        cells = json.loads(raw["percentiles"]) if raw["percentiles"] else [[None, None]] * len(_PERCENTILES)
        for name, (p50, p95) in zip(_PERCENTILES, cells):
            raw[f"{name}_p50"], raw[f"{name}_p95"] = p50, p95
    for name in ("tokens_per_s_mean", "tokens_per_s_p50", "tokens_per_s_p95"):
        row[name] = _num(raw.get(name))
    for name in ("latency", "ttft"):
        row[f"{name}_p50_s"] = _num(raw.get(f"{name}_p50"))
        row[f"{name}_p95_s"] = _num(raw.get(f"{name}_p95"))
    for name in ("acceptance_rate", "mean_accepted_length", "speedup", "device_seconds", "cost_usd"):
        row[name] = _num(raw.get(name))
    row["speedup_basis"] = SPEEDUP_BASIS if row["speedup"] is not None else None
    if row["speedup"] is None and raw.get("speedup_legacy") is not None:
        row["speedup"], row["speedup_basis"] = float(raw["speedup_legacy"]), LEGACY_BASIS
    if row["device_seconds"] is None:
        row["device_seconds"] = 0.0
    priced, out = int(raw.get("priced") or 0), int(raw.get("priced_output_tokens") or 0)
    cost = row["cost_usd"]
    row["cost_per_1m_output_tokens"] = cost / out * 1e6 if cost is not None and out else None
    row["cost_basis"] = None  # every request priced, or none: the cost says so itself
    if 0 < priced < ok:
        row["cost_basis"] = f"{priced} of {ok} requests priced; the cost and $/1M cover those only"
    return {**{g: row[g] for g in groups}, **{m: row[m] for m in METRICS}}


def _num(v: Any) -> float | None:
    return None if v is None else float(v)
