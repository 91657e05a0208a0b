"""``specdec-llm db ...`` and ``specdec-llm report``: call ``register(app)`` on the main app
(each command is a function of its own here).

Every failure a person can fix prints one line (``error: ...``) to stderr and exits 2
(``specdec_llm.cli_common``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from ..cli_common import fail, user_errors
from ..errors import SpecDecError
from .db import current_revision, downgrade, head_revision, mask_url, resolve_url, upgrade


def db_upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Create the tables or migrate them up (SPECDEC_DATABASE_URL, default SQLite in the data dir)."""
    from alembic.util import CommandError

    with user_errors():
        url = resolve_url()
        before = current_revision(url)
        try:
            after = upgrade(url, revision)
        except CommandError as e:  # alembic's "no such revision"
            fail(f"cannot upgrade to {revision!r}: {str(e).splitlines()[0]}; `specdec-llm db current` shows the head")
    change = "already at" if before == after else f"upgraded {before or 'empty'} ->"
    typer.echo(f"{mask_url(url)}: {change} {after}")


def db_downgrade(revision: str = typer.Argument(..., help='Target revision; "base" drops every table.')) -> None:
    """Migrate the schema down to REVISION."""
    try:
        url = resolve_url()
        before = current_revision(url)
        after = downgrade(url, revision)
    except SpecDecError as e:
        fail(e)
    except Exception as e:  # noqa: BLE001 - alembic's "no such revision" etc.
        fail(f"cannot downgrade to {revision!r}: {str(e).splitlines()[0]}")
    typer.echo(f"{mask_url(url)}: downgraded {before} -> {after or 'base (empty)'}")


def db_current() -> None:
    """Show the database's schema revision and this version's head."""
    with user_errors():
        url = resolve_url()
        current, head = current_revision(url), head_revision()
    state = "up to date" if current == head else "run `specdec-llm db upgrade`"
    typer.echo(f"{mask_url(url)}: revision {current or 'none'} (head {head}): {state}")


def report_cmd(
    since: str | None = typer.Option(None, help="Start: a duration back from now (7d, 12h, 30m) or a UTC date/time."),
    until: str | None = typer.Option(None, help="End (exclusive; a bare date includes that day)."),
    group_by: list[str] = typer.Option(
        ["pair"], "--group-by", "-g", help="pair, day, hour, job, worker, category, drafter (repeat or comma-separate)."
    ),
    pair: str | None = typer.Option(None, help="Only this pair (name)."),
    job: str | None = typer.Option(None, help="Only this job (id)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table, csv, json or html."),
    columns: list[str] = typer.Option(
        [],
        "--columns",
        "-c",
        help="Metrics to show, in order (comma-separate or repeat; 'all': every one), "
        "e.g. requests,tokens_per_s_p95,cost_usd. Default: the key figures first; "
        "a table wider than the terminal folds into more tables.",
    ),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write here instead of stdout."),
    price_per_hour: list[str] = typer.Option(
        [], "--price-per-hour", help="USD per device-hour: 2.5 for all, or per device kind: cuda=2.5 (repeat)."
    ),
) -> None:
    """Speed, acceptance, speedup and cost per pair/day/hour/job/worker/category."""
    from .render import report_rows

    filters = ", ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in (("since", since), ("until", until), ("pair", pair), ("job", job))
        if v
    )
    no_data = (
        f"no data: no request finished {'with ' + filters if filters else 'yet'}; widen --since or check the filters"
    )
    with user_errors():
        kw: dict[str, Any] = dict(
            since=since, until=until, group_by=group_by, pair=pair, job=job, price_per_hour=price_per_hour or None
        )
        if fmt == "table" and out is None:  # to the terminal (or a pipe: 80 columns), in its width
            _print_tables(kw, columns, no_data)
            return
        text, n = report_rows(fmt, columns=columns, **kw)
    if not n:
        typer.echo(no_data, err=True)
    if out is None:
        typer.echo(text, nl=False)
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)  # as `run --out` does
        out.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}")
    typer.echo(f"wrote {out}", err=True)


def _print_tables(filters: dict[str, Any], columns: list[str], no_data: str) -> None:
    """The report as tables fitted to the terminal's width, and the speedup's basis."""
    from rich.console import Console

    from .render import parse_columns, speedup_note, to_tables
    from .reports import summary

    parse_columns(columns)  # a bad --columns fails before the query
    rows = summary(**filters)
    if not rows:
        typer.echo(no_data, err=True)
        return
    console = Console()
    for table in to_tables(rows, console.width, columns):
        console.print(table)
    console.print(speedup_note(rows), markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    """Add the ``db`` command group (upgrade, downgrade, current) and ``report`` to ``app``."""
    db_app = typer.Typer(help="The SQL store's schema (Alembic migrations).", no_args_is_help=True)
    db_app.command("upgrade")(db_upgrade)
    db_app.command("downgrade")(db_downgrade)
    db_app.command("current")(db_current)
    app.add_typer(db_app, name="db")
    app.command("report")(report_cmd)
