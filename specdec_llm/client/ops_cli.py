"""Operating bulk jobs: ``specdec-llm jobs | workers | prune`` and ``status JOB --watch``.

Each command is a function of its own, added by ``register(app)``; thin: options checked and
output printed here, the SQL in ``specdec_llm.store.admin``. Tables fit the terminal (80
columns when it is a pipe); ``--json`` prints plain JSON. Bad input is one line naming the
option and the fix, exit 2 (``specdec_llm.cli_common``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, Group, RenderableType

import json
import sys
import time
from datetime import datetime
from typing import Annotated, Any

import typer

from specdec_llm.cli_common import fail, user_errors

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]
SinceHelp = "a duration back from now (30m, 2h, 3d, 1w) or a UTC date/time (2026-01-31, 2026-01-31T12:00)"


def _when(value: str | None, option: str) -> datetime | None:
    from specdec_llm.store.reports import parse_when

    with user_errors():
        return parse_when(value, option)


def _json(value: Any) -> str:
    return json.dumps(value, default=lambda v: v.isoformat() if isinstance(v, datetime) else str(v))


def ago(seconds: float) -> str:
    """42s, 12m, 5h, 3d: how long ago, in one short word."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{max(0.0, seconds):.0f}s"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


FIT, SHRINK, NUMBER = "fit", "shrink", "number"  # never cut (ids, states) / cut first (names) / never cut, right


def _print_table(columns: list[tuple[str, str]], rows: list[list[Any]]) -> None:
    """A borderless table in the terminal's width (80 columns in a pipe), one line a row:
    every ``FIT``/``NUMBER`` column as wide as its widest cell, the ``SHRINK`` columns (names)
    sharing what is left, cut with an ellipsis. Cells are plain text, never rich markup."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    cells = [[v if isinstance(v, Text) else Text(str(v)) for v in row] for row in rows]
    natural = [max([len(h), *(len(r[i].plain) for r in cells)]) for i, (h, _) in enumerate(columns)]
    widths, shrink = list(natural), [i for i, (_, kind) in enumerate(columns) if kind == SHRINK]
    left = console.width - (len(columns) - 1) - sum(n for i, n in enumerate(natural) if i not in shrink)
    for n, i in enumerate(sorted(shrink, key=lambda i: natural[i])):  # the narrow ones keep their width
        widths[i] = max(3, min(natural[i], left // (len(shrink) - n)))
        left -= widths[i]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=0)  # the box: one space between
    for (header, kind), width in zip(columns, widths):
        table.add_column(
            header, width=width, no_wrap=True, overflow="ellipsis", justify="right" if kind == NUMBER else "left"
        )
    for row in cells:
        table.add_row(*row)
    console.print(table)


# -- jobs ------------------------------------------------------------------------------------
def jobs_cmd(
    state: Annotated[
        str | None, typer.Option("--state", help="Only jobs in this state: queued, running or done")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Only jobs whose name contains this")] = None,
    since: Annotated[str | None, typer.Option("--since", help=f"Only jobs created since: {SinceHelp}")] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most this many jobs, newest first")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """The jobs, newest first: id, name, pair, state, rows ok/failed/pending, tokens/s, age."""
    from specdec_llm.store import admin

    if limit < 1:
        fail(f"limit: {limit} shows nothing; use --limit 1 or more (default 20)")
    since_dt = _when(since, "since")
    with user_errors():
        rows = admin.list_jobs(state=state, name=name, since=since_dt, limit=limit)
    if as_json:
        print(_json(rows))
        return
    if not rows:
        print("no jobs" + (" match; widen --since or drop --state/--name" if state or name or since else " yet"))
        return
    columns = [
        ("job", FIT),
        ("name", SHRINK),
        ("pair", SHRINK),
        ("state", FIT),
        ("ok/fail/pend", NUMBER),
        ("tok/s", NUMBER),
        ("age", NUMBER),
    ]
    cells = [
        [
            j["id"],
            j["name"] or "-",
            j["pair"] or "-",
            "stopping" if j["cancel_requested"] and j["pending"] else j["state"],
            f"{j['ok']}/{j['failed']}/{j['pending']}",
            _rate(j["tokens_per_s"]),
            ago(j["age_s"]),
        ]
        for j in rows
    ]
    _print_table(columns, cells)


# -- workers ---------------------------------------------------------------------------------
def workers_cmd(
    since: Annotated[
        str, typer.Option("--since", help=f"Workers whose latest heartbeat is at most this old: {SinceHelp}")
    ] = "1d",
    as_json: JsonOpt = False,
) -> None:
    """The live workers from their heartbeats, stale ones marked.

    Host, pid, pair, device, dtype, max batch, rows done, tokens/s (last minute), last seen; a
    worker silent for the lease timeout (SPECDEC_LEASE_TIMEOUT_S) is stale; one that stopped
    cleanly says so."""
    from rich.text import Text

    from specdec_llm.settings import get_settings
    from specdec_llm.store import admin

    since_dt = _when(since, "since")
    stale_after = get_settings().lease_timeout_s
    with user_errors():
        rows = admin.list_workers(stale_after_s=stale_after, since=since_dt)
    if as_json:
        print(_json(rows))
        return
    if not rows:
        when = f" since {since_dt:%Y-%m-%d %H:%M} UTC" if since_dt else ""
        print(f"no worker heartbeat{when}; start one with `specdec-llm worker`")
        return
    columns = [
        ("host", SHRINK),
        ("pid", NUMBER),
        ("pair", SHRINK),
        ("device", FIT),
        ("dtype", FIT),
        ("batch", NUMBER),
        ("rows", NUMBER),
        ("tok/s", NUMBER),
        ("seen", NUMBER),
        ("", FIT),
    ]
    cells = [
        [
            w["host"],
            w["pid"],
            w["pair"] or "-",
            w["device"],
            w["dtype"] or "-",
            "-" if w["max_batch"] is None else w["max_batch"],
            w["rows_done"],
            _rate(w["tokens_per_s"]),
            ago(w["last_seen_s"]),
            "stopped" if w.get("stopped") else Text("stale", style="bold red") if w["stale"] else "live",
        ]
        for w in rows
    ]
    _print_table(columns, cells)
    if any(w["stale"] for w in rows):
        print(f"stale: no heartbeat for {stale_after:g} s (SPECDEC_LEASE_TIMEOUT_S): stopped, or cut off")


# -- prune -----------------------------------------------------------------------------------
def prune_cmd(
    older_than: Annotated[
        str | None,
        typer.Option("--older-than", help=f"Delete finished jobs last used before this: {SinceHelp}"),
    ] = None,
    job: Annotated[str | None, typer.Option("--job", help="Only this job (still: if finished and that old)")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
) -> None:
    """Delete finished jobs older than --older-than, with their rows, outputs and telemetry.

    A few thousand rows per transaction (the store stays usable meanwhile); asks first unless
    --yes; prints what it freed."""
    import click

    from specdec_llm import store
    from specdec_llm.store import admin

    if older_than is None:
        fail("older-than: say how old a finished job must be to go, e.g. --older-than 30d")
    cutoff = _when(older_than, "older-than")
    assert cutoff is not None
    if cutoff > store.utcnow():
        fail(f"older-than: {older_than!r} is in the future; give a duration like 30d or a past date")
    with user_errors():
        if job is not None:
            from specdec_llm import client

            client.get_job(job)  # an unknown job: one line, exit 2
        plan = admin.prune_plan(cutoff, job_id=job)
    when = f"last used before {cutoff:%Y-%m-%d %H:%M} UTC"
    kept = [f"{plan['unfinished']} older jobs still have rows to run"] if plan["unfinished"] else []
    kept += [f"{plan['held']} finished ones are still in use (a `run` writing its results)"] if plan["held"] else []
    kept_note = f" ({', '.join(kept)}: kept)" if kept else ""
    if not plan["jobs"]:
        print(f"nothing to prune: no finished {'job ' + job if job else 'job'} {when}{kept_note}")
        return
    if not yes:
        question = f"delete {plan['jobs']} finished jobs {when} and their {plan['rows']} rows (outputs, telemetry)?"
        try:
            agreed = typer.confirm(question, default=False)
        except (click.Abort, typer.Abort):  # Ctrl-C or no input (typer's own click has its own Abort)
            agreed = False
        if not agreed:
            print("nothing deleted (add --yes to delete without asking)")
            raise typer.Exit(1)

    def progress(freed: dict[str, Any]) -> None:
        print(f"  ... {freed['rows']} rows, {freed['jobs']} jobs deleted", file=sys.stderr)

    with user_errors():
        freed = admin.prune(cutoff, job_id=job, on_batch=progress)
    print(
        f"freed {freed['jobs']} jobs, {freed['rows']} rows, {freed['outputs']} outputs and "
        f"{freed['telemetry']} telemetry rows{kept_note}"
    )


# -- status --watch --------------------------------------------------------------------------
def _pause(seconds: float) -> None:  # (tests replace it)
    time.sleep(seconds)


def watch_status(job: str, *, interval: float, as_json: bool, price_per_hour: Any = None) -> None:
    """``status JOB --watch``: a live view of the job (rows, tokens/s, acceptance, ETA),
    looked at every ``interval`` s until no row is pending; not a terminal (a file, a pipe): a
    plain line per look; ``--json``: one object per line and per look, nothing else on stdout
    (the last line and Ctrl-C's go to stderr). Ctrl-C stops watching only: the job goes on
    (exit 0, and a line saying so)."""
    from rich.console import Console

    from specdec_llm import client

    if not 0 < interval <= 3600:  # (inf would overflow the clock)
        fail(f"interval: {interval:g} s; use a number of seconds above 0 and at most 3600, e.g. --interval 2")
    with user_errors():  # an unknown job or an unusable store: one line, before any view
        st = client.status(job, price_per_hour=price_per_hour)
    console = Console()
    watch = _watch_json if as_json else _watch_live if console.is_terminal else _watch_lines
    said = sys.stderr if as_json else sys.stdout  # --json: stdout holds JSON lines only
    try:
        st = watch(st, console, interval, price_per_hour)
    except KeyboardInterrupt:
        print(f"stopped watching; job {job} keeps running (`specdec-llm cancel {job}` stops it)", file=said)
        return
    c = st["counts"]
    print(f"job {job}: done: {c['ok']} ok, {c['failed']} failed, {c['cancelled']} cancelled", file=said)


def _look(st: dict[str, Any], interval: float, price_per_hour: Any) -> tuple[dict[str, Any], str]:
    """Wait, then the job's status again; a store away for a moment keeps the last one, and says so."""
    from specdec_llm import client
    from specdec_llm.errors import SpecDecError

    _pause(interval)
    try:
        return client.status(st["job_id"], price_per_hour=price_per_hour), ""
    except SpecDecError as e:
        return st, f"(cannot read the store: {e}; looking again)"


def _watch_live(st: dict[str, Any], console: Console, interval: float, price_per_hour: Any) -> dict[str, Any]:
    from rich.live import Live

    with Live(_view(st), console=console, auto_refresh=False) as live:
        while st["status"] != "done":
            st, note = _look(st, interval, price_per_hour)
            live.update(_view(st, note), refresh=True)
    return st


def _watch_json(st: dict[str, Any], console: Console, interval: float, price_per_hour: Any) -> dict[str, Any]:
    print(_json(st), flush=True)
    while st["status"] != "done":
        st, note = _look(st, interval, price_per_hour)
        if not note:
            print(_json(st), flush=True)
    return st


def _watch_lines(st: dict[str, Any], console: Console, interval: float, price_per_hour: Any) -> dict[str, Any]:
    """Not a terminal (a file, a pipe): one plain line per look, written as it is seen."""
    print(_line(st), flush=True)
    while st["status"] != "done":
        st, note = _look(st, interval, price_per_hour)
        print(_line(st, note), flush=True)
    return st


def _line(st: dict[str, Any], note: str = "") -> str:
    """One look at a job as one plain line (``_view``'s content)."""
    c, total = st["counts"], st["total"]
    acc, eta = st["acceptance_rate"], "-" if st["eta_s"] is None else ago(st["eta_s"])
    line = (
        f"job {st['job_id']} {st['status']}: {c['ok'] + c['failed'] + c['cancelled']}/{total} rows "
        f"({st['progress']:.0%}); {', '.join(f'{k} {v}' for k, v in c.items())}; {st['output_tokens']} tokens, "
        f"{_rate(st['throughput_tokens_per_s'])} tok/s; acceptance {'-' if acc is None else f'{acc:.1%}'}; "
        f"elapsed {ago(st['elapsed_s'])}, ETA {eta}"
    )
    if st["lost"] or st["requeued"]:
        line += f"; {st['lost'] + st['requeued']} rows lost their worker: requeued on their own"
    return f"{line} {note}" if note else line


def _view(st: dict[str, Any], note: str = "") -> Group:
    """One look at a job: a progress bar, its rows by state, speed, acceptance and ETA."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    c, total = st["counts"], st["total"]
    done = c["ok"] + c["failed"] + c["cancelled"]
    head = Table.grid(padding=(0, 1))
    head.add_row(
        Text(f"job {st['job_id']} {st['status']}"),
        ProgressBar(total=max(total, 1), completed=done, width=24),
        Text(f"{done}/{total} rows ({st['progress']:.0%})"),
    )
    rate, acc = _rate(st["throughput_tokens_per_s"]), st["acceptance_rate"]
    eta = "-" if st["eta_s"] is None else ago(st["eta_s"])
    lines: list[RenderableType] = [
        head,
        Text(", ".join(f"{k} {v}" for k, v in c.items())),
        Text(
            f"{st['output_tokens']} tokens, {rate} tok/s; acceptance {'-' if acc is None else f'{acc:.1%}'}; "
            f"elapsed {ago(st['elapsed_s'])}, ETA {eta}"
        ),
    ]
    if st["lost"] or st["requeued"]:
        lines.append(Text(f"{st['lost'] + st['requeued']} rows lost their worker: requeued on their own"))
    if note:
        lines.append(Text(note))
    return Group(*lines)


def register(app: typer.Typer) -> None:
    """Add ``jobs``, ``workers`` and ``prune`` to ``app`` (``status --watch`` is ``status``'s)."""
    app.command("jobs")(jobs_cmd)
    app.command("workers")(workers_cmd)
    app.command("prune")(prune_cmd)
