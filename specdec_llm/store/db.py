"""Engines, sessions and schema (Alembic) for the store.

The URL comes from ``SPECDEC_DATABASE_URL`` (settings); by default a SQLite file in the
user's data directory, in WAL mode. Errors meant for a person are ``StoreError``: one
line that says what to do, with any password in a URL masked.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from ..errors import SpecDecError
from ..settings import get_settings

if TYPE_CHECKING:
    import sqlite3

    from alembic.config import Config

log = logging.getLogger(__name__)
# alembic names each of its plugins at INFO whenever it loads (seven lines at every worker start)
logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"

_engines: dict[str, Engine] = {}
_sessionmakers: dict[str, sessionmaker[Session]] = {}
_ready: set[str] = set()


class StoreError(SpecDecError, RuntimeError):
    """A problem a person can fix; ``str(e)`` is one line saying how."""


class SchemaError(StoreError):
    """The database's schema is not the one this code expects."""


class StoreUnavailable(StoreError):
    """The database cannot be used now (unreachable, a connection lost, locked): trying again
    later may work. ``str(e)`` names the database (password masked) and the reason."""


# What a caller may retry on (a worker's task, a client waiting on a job): the store's own
# StoreUnavailable, and the driver's connection errors met outside a session. Callers catch
# this tuple and never import SQLAlchemy.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (StoreUnavailable, exc.OperationalError, exc.InterfaceError)


# --- URLs ---------------------------------------------------------------------------


def resolve_url(url: str | None = None) -> str:
    url = url or get_settings().effective_database_url
    try:
        make_url(url)
    except (exc.ArgumentError, ValueError):
        shown = mask_userinfo(url)  # no password, even here
        raise StoreError(
            f"cannot read the database URL {shown!r}; set SPECDEC_DATABASE_URL to e.g. "
            "sqlite:////path/specdec.db or postgresql+psycopg://user@host/db"
        ) from None
    return url


_SECRET_QUERY = re.compile(r"([?&](?:password|passwd|pwd|sslpassword|secret|token|access_token)=)[^&#]*", re.IGNORECASE)


def mask_query(text: str) -> str:
    """``text`` with the values of password-like query parameters (``?password=...``) hidden."""
    return _SECRET_QUERY.sub(r"\1***", text)


def mask_userinfo(text: str) -> str:
    """``text``, a URL that may not parse, with its ``user:PASSWORD@`` password (which may hold
    "/") and password-like query values hidden; text that is no URL at all is not shown (it
    may be a password pasted in)."""
    if "://" not in text:
        return "(not a URL)"
    # to the last "@" before the query: a password may hold "@" (kombu and urlsplit read it so)
    return mask_query(re.sub(r"(//[^/:@]*:)[^?#]*@", r"\1***@", text))


def mask_url(url: str) -> str:
    """The URL with its password hidden (``user:pass@`` and ``?password=...``), fit for logs
    and error messages."""
    try:
        return mask_userinfo(make_url(url).render_as_string(hide_password=True))  # (an "@" in it: all of it)
    except (exc.ArgumentError, ValueError):
        return "<unreadable database URL>"


def sqlite_path(url: str) -> Path | None:
    """The file behind a SQLite URL; None for other databases and in-memory SQLite."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or not u.database or u.database == ":memory:":
        return None
    if u.query.get("uri") == "true" and u.database.startswith("file:"):  # sqlite:///file:/path?mode=ro&uri=true
        from urllib.parse import unquote, urlsplit

        path = unquote(urlsplit(u.database).path)
        return None if not path or path == ":memory:" else Path(path)
    return Path(u.database)


# --- engines and sessions -----------------------------------------------------------


class _Percentiles:
    """SQLite aggregate ``specdec_percentiles(x, y, z)``: the 50th and 95th percentile of
    each argument (linear interpolation, as PostgreSQL's ``percentile_cont``; NULLs
    skipped), as JSON ``[[p50, p95], [p50, p95], [p50, p95]]``. PostgreSQL uses its own
    ``percentile_cont`` instead. Three fixed arguments: each call from SQLite into
    Python is the cost here (about 0.3 us a row)."""

    def __init__(self) -> None:
        self.x: list[float | None] = []
        self.y: list[float | None] = []
        self.z: list[float | None] = []

    def step(self, x: float | None, y: float | None, z: float | None) -> None:
        self.x.append(x)
        self.y.append(y)
        self.z.append(z)

    def finalize(self) -> str:
        import numpy as np

        out: list[list[float | None]] = []
        for values in (self.x, self.y, self.z):
            a = np.array(values, dtype=float)  # None -> nan
            a = a[~np.isnan(a)]
            out.append([float(p) for p in np.percentile(a, [50, 95])] if a.size else [None, None])
        return json.dumps(out)


def _on_sqlite_connect(dbapi_conn: sqlite3.Connection, _record: object) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers don't block the writer
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
    dbapi_conn.create_aggregate("specdec_percentiles", 3, _Percentiles)  # type: ignore[arg-type]  # typeshed: 1 argument only


def make_engine(url: str, **kw: Any) -> Engine:
    """A new engine with the store's per-connection setup (SQLite pragmas, aggregate)."""
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        kw.setdefault("connect_args", {"timeout": 30})
    elif backend == "postgresql":
        kw.setdefault("connect_args", {"connect_timeout": 10})
        kw.setdefault("pool_pre_ping", True)
    try:
        engine = create_engine(url, **kw)
    except (exc.NoSuchModuleError, ImportError) as e:  # an unknown dialect, or its driver not installed (mysql://)
        missing = f" (its driver is not installed: {e})" if isinstance(e, ImportError) else ""
        raise StoreError(
            f"SPECDEC_DATABASE_URL: no usable SQLAlchemy driver for {mask_url(url)}{missing}; the store runs on "
            "SQLite or PostgreSQL: set SPECDEC_DATABASE_URL to sqlite:////path/specdec.db or postgresql+psycopg://user@host/db"
        ) from None
    if backend == "sqlite":
        event.listen(engine, "connect", _on_sqlite_connect)
    return engine


def _after_fork_in_child() -> None:
    # A forked worker (Celery prefork) must not reuse its parent's connections:
    # SQLAlchemy's recipe is dispose(close=False) in the child.
    for engine in _engines.values():
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_engine(url: str | None = None) -> Engine:
    """The process-wide engine for ``url`` (default: settings)."""
    url = resolve_url(url)
    if url not in _engines:
        _engines[url] = make_engine(url)
    return _engines[url]


def get_sessionmaker(url: str | None = None) -> sessionmaker[Session]:
    url = resolve_url(url)
    if url not in _sessionmakers:
        _sessionmakers[url] = sessionmaker(get_engine(url), expire_on_commit=False)
    return _sessionmakers[url]


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error.

    Connection failures become a one-line ``StoreUnavailable``.
    """
    url = resolve_url(url)
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except exc.OperationalError as e:
        session.rollback()
        raise unreachable(url, e) from None
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def dispose_engine(url: str | None = None) -> None:
    """Close pooled connections for ``url`` (all engines when None) and forget them."""
    urls = [url] if url else list(_engines)
    for u in urls:
        engine = _engines.pop(u, None)
        _sessionmakers.pop(u, None)
        _ready.discard(u)
        if engine is not None:
            engine.dispose()


def unreachable(url: str, error: Exception) -> StoreUnavailable:
    reason = mask_query(str(getattr(error, "orig", None) or error).strip().splitlines()[0])
    u = make_url(url)
    for secret in (u.password, *(v for k, v in u.query.items() if _SECRET_QUERY.match(f"?{k}="))):
        if secret and isinstance(secret, str):
            reason = reason.replace(secret, "***")
    return StoreUnavailable(
        f"cannot use the database at {mask_url(url)} ({reason}); "
        "check SPECDEC_DATABASE_URL and that the server is running"
    )


# --- schema (Alembic) ---------------------------------------------------------------


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = url  # read by migrations/env.py
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if head is None:
        raise StoreError(f"no migrations in {MIGRATIONS_DIR}: this installation is incomplete; reinstall specdec-llm")
    return head


def current_revision(url: str | None = None) -> str | None:
    """The database's revision; None for an empty database. Writes nothing."""
    from alembic.runtime.migration import MigrationContext

    url = resolve_url(url)
    path = sqlite_path(url)
    if path is not None and not path.exists():
        return None
    try:
        with get_engine(url).connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except exc.OperationalError as e:
        raise unreachable(url, e) from None


@contextmanager
def _sqlite_migration_lock(url: str) -> Iterator[None]:
    """Serialise upgrades of one SQLite file across processes (PostgreSQL takes an
    advisory lock in migrations/env.py instead)."""
    path = sqlite_path(url)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    with open(f"{path}.migrate-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def upgrade(url: str | None = None, revision: str = "head") -> str | None:
    """Migrate the database up to ``revision``; returns the new revision."""
    from alembic import command

    url = resolve_url(url)
    try:
        with _sqlite_migration_lock(url):
            command.upgrade(alembic_config(url), revision)
    except exc.OperationalError as e:
        raise unreachable(url, e) from None
    _ready.discard(url)
    return current_revision(url)


def downgrade(url: str | None, revision: str) -> str | None:
    """Migrate the database down to ``revision`` ("base" drops every table)."""
    from alembic import command

    url = resolve_url(url)
    try:
        command.downgrade(alembic_config(url), revision)
    except exc.OperationalError as e:
        raise unreachable(url, e) from None
    _ready.discard(url)
    return current_revision(url)


def check_schema(url: str | None = None) -> None:
    """Raise a ``StoreError`` unless the database exists at the head revision. Writes nothing."""
    url = resolve_url(url)
    if url in _ready:
        return
    path = sqlite_path(url)
    if path is not None and not path.exists():
        raise SchemaError(f"no database at {path} yet; run `specdec-llm db upgrade` to create it")
    current, head = current_revision(url), head_revision()
    if current == head:
        _ready.add(url)
        return
    masked = mask_url(url)
    if current is None:
        raise SchemaError(f"the database at {masked} has no specdec-llm tables; run `specdec-llm db upgrade`")
    if _is_known(current):
        raise SchemaError(
            f"the database at {masked} is at schema revision {current}, this version needs {head}; "
            "run `specdec-llm db upgrade`"
        )
    raise SchemaError(
        f"the database at {masked} is at schema revision {current}, unknown to this version "
        f"(head {head}); upgrade specdec-llm, or point SPECDEC_DATABASE_URL elsewhere"
    )


def _is_known(revision: str) -> bool:
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(alembic_config("sqlite://")).get_revision(revision) is not None
    except CommandError:
        return False


def ensure_schema(url: str | None = None) -> None:
    """Make the database usable by writers: an empty or older database is upgraded to
    head (logged); an unreachable one or one from a newer version raises ``StoreError``."""
    url = resolve_url(url)
    if url in _ready:
        return
    try:
        check_schema(url)
    except SchemaError:
        current = current_revision(url)
        if current is not None and not _is_known(current):
            raise
        log.warning("upgrading the database at %s from %s to %s", mask_url(url), current or "empty", head_revision())
        upgrade(url)
        _ready.add(url)
