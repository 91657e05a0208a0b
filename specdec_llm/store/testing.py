"""Throwaway databases for tests: a SQLite file URL, or a fresh PostgreSQL database.

    with temporary_postgres() as url:   # creates specdec_test_<random>, drops it after
        ...

The server is ``SPECDEC_TEST_POSTGRES_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); the database in that URL is
only used to run CREATE/DROP DATABASE.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from .db import dispose_engine

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def sqlite_url(directory: Path, name: str = "specdec.db") -> str:
    return f"sqlite:///{Path(directory) / name}"


def postgres_admin_url() -> str:
    return os.environ.get("SPECDEC_TEST_POSTGRES_URL", ADMIN_URL)


def postgres_available() -> str | None:
    """None when the test server answers, else why not (one line)."""
    engine = create_engine(postgres_admin_url(), connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "not available"
        return str(getattr(e, "orig", e)).strip().splitlines()[0]
    finally:
        engine.dispose()


def require_postgres() -> None:
    """Skip the calling test when the PostgreSQL test server is unreachable; fail under CI=true."""
    import pytest

    why = postgres_available()
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL test server unreachable on CI: {why}")
        pytest.skip(f"PostgreSQL test server unreachable: {why}")


@contextmanager
def temporary_postgres(prefix: str = "specdec_test") -> Iterator[str]:
    """Create an empty database with a unique name; yield its URL; drop it afterwards."""
    admin_url = make_url(postgres_admin_url())
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5})
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        url = admin_url.set(database=name).render_as_string(hide_password=False)
        try:
            yield url
        finally:
            dispose_engine(url)
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()
