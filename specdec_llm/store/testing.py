"""Throwaway databases for tests: a SQLite file URL, or a fresh PostgreSQL database; and a
big store, fast (``seed_finished_jobs``: benchmarks of prune and reports).

    with temporary_postgres() as url:   # creates specdec_test_<random>, drops it after
        ...

The server is ``SPECDEC_TEST_POSTGRES_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); the database in that URL is
only used to run CREATE/DROP DATABASE.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from itertools import islice
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from .db import dispose_engine, get_engine, session_scope
from .models import Job, Telemetry
from .record import upsert_pair

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


_REQUEST_COLUMNS = (
    "id",
    "job_id",
    "pair_id",
    "status",
    "attempts",
    "requeues",
    "created_at",
    "started_at",
    "finished_at",
)
_OUTPUT_COLUMNS = ("request_id", "text", "token_ids", "prompt_tokens", "output_tokens", "finish_reason", "created_at")


def seed_finished_jobs(
    url: str,
    *,
    jobs: int,
    rows_per_job: int,
    created_at: datetime,
    prefix: str = "job",
    pair: str = "bench-pair",
    chunk: int = 50_000,
) -> int:
    """Bulk-insert ``jobs`` finished jobs of ``rows_per_job`` ok rows each, every row with its
    output and its telemetry, into the store at ``url`` (at head): job ``i`` (id
    ``<prefix><i:06d>``) created at ``created_at`` + i seconds, its rows finished 60 s later.
    Bypasses the writers (no upsert per row): COPY on PostgreSQL, executemany on SQLite, in
    transactions of ``chunk`` rows. Returns the rows inserted."""
    pair_id = upsert_pair(pair, dtype="float32", device="cpu", url=url)
    engine = get_engine(url)
    pg = engine.dialect.name == "postgresql"

    job_rows = _finished_jobs(jobs, rows_per_job, created_at, prefix, pair_id)
    with session_scope(url) as s:
        s.execute(insert(Job), job_rows)
    keys: Iterator[tuple[str, datetime, int]] = (
        (str(j["id"]), created_at + timedelta(seconds=i), r)
        for i, j in enumerate(job_rows)
        for r in range(rows_per_job)
    )
    total = 0
    while batch := list(islice(keys, chunk)):
        _copy_rows(engine, pg, _finished_rows(batch, pair_id, pg))
        total += len(batch)
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()
    return total


def _finished_jobs(
    jobs: int, rows_per_job: int, created_at: datetime, prefix: str, pair_id: int
) -> list[dict[str, Any]]:
    """``seed_finished_jobs``'s job rows: done, every row ok, finished 60 s after their creation."""
    job_rows = []
    for i in range(jobs):
        created = created_at + timedelta(seconds=i)
        job_rows.append(
            dict(
                id=f"{prefix}{i:06d}",
                name=f"{prefix} {i}",
                pair_id=pair_id,
                status="done",
                n_requests=rows_per_job,
                n_ok=rows_per_job,
                n_failed=0,
                created_at=created,
                started_at=created,
                finished_at=created + timedelta(seconds=60),
            )
        )
    return job_rows


def _finished_rows(
    batch: list[tuple[str, datetime, int]], pair_id: int, pg: bool
) -> list[tuple[str, Sequence[str], list[tuple[Any, ...]]]]:
    """The request, output and telemetry rows of ``batch`` ((job id, its creation, row number)
    each), by table, for ``_copy_rows``."""

    def when(dt: datetime) -> Any:
        return dt if pg else dt.strftime("%Y-%m-%d %H:%M:%S.%f")  # SQLAlchemy's SQLite format

    tel_columns = [c.name for c in Telemetry.__table__.columns]
    reqs: list[tuple[Any, ...]] = []
    outs: list[tuple[Any, ...]] = []
    tels: list[tuple[Any, ...]] = []
    for job_id, created, r in batch:
        rid, done = f"{job_id}-{r}", when(created + timedelta(seconds=60))
        reqs.append((rid, job_id, pair_id, "ok", 1, 0, when(created), when(created), done))
        outs.append((rid, "x", "[1, 2, 3]", 8, 3 + r % 61, "length", done))
        tel = _telemetry(rid, job_id, pair_id, done, output_tokens=3 + r % 61)
        tels.append(tuple(tel.get(c) for c in tel_columns))
    return [("requests", _REQUEST_COLUMNS, reqs), ("outputs", _OUTPUT_COLUMNS, outs), ("telemetry", tel_columns, tels)]


def _telemetry(request_id: str, job_id: str, pair_id: int, finished: Any, *, output_tokens: int) -> dict[str, Any]:
    """One finished row's telemetry: plausible, deterministic figures."""
    wall = output_tokens / 20.0
    proposed = output_tokens
    accepted = output_tokens // 2
    return dict(
        request_id=request_id,
        pair_id=pair_id,
        job_id=job_id,
        device="cpu",
        device_kind="cpu",
        dtype="float32",
        finished_at=finished,
        queue_wait_s=0.01,
        prompt_tokens=8,
        output_tokens=output_tokens,
        draft_tokens_proposed=proposed,
        draft_tokens_accepted=accepted,
        acceptance_rate=accepted / proposed,
        mean_accepted_length=1 + 2 * accepted / proposed,
        per_position_acceptance="[0.6, 0.4]",
        target_forwards=output_tokens - accepted,
        draft_forwards=proposed,
        draft_time_s=wall * 0.3,
        target_time_s=wall * 0.65,
        wall_time_s=wall,
        time_to_first_token_s=0.05,
        tokens_per_s=output_tokens / wall,
        k_values="[2]",
        batch_rows=1.0,
        drafter="model",
        drafter_tokens='{"model": {"proposed": 2, "accepted": 1}}',
        baseline_s=wall * 1.5,
        finish_reason="length",
    )


def _copy_rows(engine: Any, pg: bool, tables: list[tuple[str, Sequence[str], list[tuple[Any, ...]]]]) -> None:
    """Insert each (table, columns, rows) in one transaction: COPY (PostgreSQL) or executemany."""
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        for table, columns, rows in tables:
            names = ", ".join(columns)
            if pg:
                with cur.copy(f"COPY {table} ({names}) FROM STDIN") as cp:
                    for row in rows:
                        cp.write_row(row)
            else:
                cur.executemany(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))})", rows)
        raw.commit()
    finally:
        raw.close()
