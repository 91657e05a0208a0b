"""The statement helpers the store's writers share (``record``, ``jobs``, ``admin``).

- ``writing(url)``: a session on a database upgraded first (``db.ensure_schema``), committed
  on success; every write goes through one.
- ``dialect_insert(session, model)``: the dialect's INSERT, with ``on_conflict_do_nothing``
  and ``on_conflict_do_update`` (SQLite and PostgreSQL both), so duplicate writes race safely.
- ``chunks(items)``: a long id list cut into IN (...) lists of at most ``CHUNK`` ids.
- ``db_now(session)``: the database's clock, the one clock of leases and liveness.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar, cast

from sqlalchemy import Table, exc, func, select
from sqlalchemy.orm import Session

from .db import StoreError, ensure_schema, resolve_url, session_scope
from .models import Base, utcnow

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert as PostgresInsert
    from sqlalchemy.dialects.sqlite import Insert as SqliteInsert

CHUNK = 500  # ids per IN (...) list

T = TypeVar("T")


@contextmanager
def writing(url: str | None) -> Iterator[Session]:
    """A session for writes on ``url`` (default: settings): an empty or older database is
    upgraded first; commits on success, rolls back on error (``db.session_scope``); a value
    the database refuses (too long, a NUL in text) is a ``StoreError`` saying so."""
    url = resolve_url(url)
    ensure_schema(url)
    try:
        with session_scope(url) as session:
            yield session
    except exc.DataError as e:  # a value the database cannot hold: one line, not a traceback
        reason = str(e.orig or e).strip().splitlines()[0]
        raise StoreError(
            f"the database refused a value ({reason}); nothing of this write was stored: shorten the text "
            "or remove the NUL character (\\x00) it names, then try again"
        ) from e


def dialect_insert(session: Session, model: type[Base]) -> PostgresInsert | SqliteInsert:
    """A Core INSERT into ``model``'s table for the session's dialect, with
    ``on_conflict_do_nothing/update``. (To learn whether a row went in, use RETURNING:
    psycopg reports no rowcount for these.)"""
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(cast(Table, model.__table__))
    from sqlalchemy.dialects import sqlite

    return sqlite.insert(cast(Table, model.__table__))


def chunks(items: list[T], n: int = CHUNK) -> Iterable[list[T]]:
    """``items`` in consecutive lists of at most ``n`` (one IN (...) list each)."""
    for i in range(0, len(items), n):
        yield items[i : i + n]


def db_now(session: Session) -> datetime:
    """The database's current time, naive UTC: the one clock of every time a lease or a liveness
    check compares (rows' ``heartbeat_at``, ``started_at``, ``created_at``; lease cut-offs;
    workers' heartbeats; jobs' ``held_until`` and ``cancelled_at``), so hosts sharing a store
    whose clocks disagree neither take over each other's live rows nor keep a dead worker's.
    PostgreSQL: ``statement_timestamp()``, when this query started (``now()`` is when the
    transaction began, which may be earlier). SQLite: the database is a file on this host, whose
    clock is this process's (``utcnow``)."""
    if session.get_bind().dialect.name != "postgresql":
        return utcnow()
    return cast(datetime, session.scalar(select(func.timezone("utc", func.statement_timestamp()))))
