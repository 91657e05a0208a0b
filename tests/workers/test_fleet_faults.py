"""A fleet through its faults (#45): three workers, a private redis-server and a private
PostgreSQL cluster (``initdb`` in a temporary folder, its own port), one job of 120 short rows (16
steps each, paced at 25 ms a step: a model's pace without its CPU), leases of 8 s (heartbeat
0.8 s). During the job: one worker SIGKILLed (mid-row, with its pool child), Redis stopped for
6 s then started, PostgreSQL stopped for 6 s then started. Every row ends exactly once and the job
finishes by itself: the product's own recovery only (leases, task retries, ``wait`` as ``run``
waits), no ``retry``. Prints the recovery time after each fault, the rows delivered again and
the duplicates (0).

The times scale with the lease: heartbeat a tenth of it, each outage three quarters of it (long
enough that heartbeats fail, shorter than the lease), ``run``'s resend of lost rows after one
lease. The run docs/operations.md reports (20 s leases, 15 s outages, 600 rows):
``FLEET_LEASE_S=20 FLEET_ROWS=600 pytest tests/workers/test_fleet_faults.py``."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest
from fleet import (
    PrivatePostgres,
    PrivateRedis,
    assert_exactly_once,
    make_fleet,
    paced_steps,
    postgres_bindir,
    write_prompts,
)
from helpers import free_port, unavailable
from sqlalchemy import func, select

from specdec_llm import client, store
from specdec_llm.store.db import dispose_engine
from specdec_llm.store.models import Request, Telemetry

pytestmark = pytest.mark.slow

ROWS = int(os.environ.get("FLEET_ROWS", "120"))  # rows still wait after the last fault (at 35 %)
LEASE_S = float(os.environ.get("FLEET_LEASE_S", "8"))  # a lost row is back in ~LEASE_S
OUTAGE_S = 0.75 * LEASE_S
STEP_S = 0.025  # s each row's step takes at least (16 steps a row): a model's pace, without its CPU
ROW = {"max_new_tokens": 16, "k": 0}
LEASE = {"SPECDEC_LEASE_HEARTBEAT_S": str(LEASE_S / 10), "SPECDEC_LEASE_TIMEOUT_S": str(LEASE_S)}


def finished(job: str) -> int | None:
    """Rows of ``job`` finished so far (None while the database is away)."""
    try:
        c = client.job_counts(job)
    except store.StoreError:
        return None
    return c["ok"] + c["failed"] + c["cancelled"]


def until(predicate, timeout: float, what: str) -> float:
    """Wait until ``predicate()``; the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise TimeoutError(what)
        time.sleep(0.2)
    return time.monotonic() - start


def held_by(job: str, pid: int) -> list[str]:
    """Rows of ``job`` running under the lease of the worker whose main process is ``pid``."""
    with store.session_scope() as s:
        rows = s.execute(
            select(Request.id, Request.lease_owner).where(Request.job_id == job, Request.status == "running")
        ).all()
    return [rid for rid, owner in rows if owner and re.match(rf"specdec-tiny-{pid}@", owner)]


def back(request_id: str) -> bool:
    """Whether a row whose worker was killed is pending again under no lease, or done."""
    row = store.get_request(request_id)
    return row["status"] == "ok" or (row["requeues"] > 0 and row["lease_owner"] is None) or row["attempts"] > 1


def progress_after(job: str, fault: str, timeout: float = 240) -> float:
    """Seconds from now until a row of ``job`` finishes (the fleet works again after ``fault``)."""
    start = time.monotonic()
    before = None
    while before is None:
        before = finished(job)
        time.sleep(0.1)
    until(lambda: (finished(job) or 0) > before, timeout - (time.monotonic() - start), f"no progress after {fault}")
    return time.monotonic() - start


def test_a_fleet_survives_a_sigkill_and_its_broker_and_database_restarting(pairs_toml, use):
    redis_exe, bindir = shutil.which("redis-server"), postgres_bindir()
    if redis_exe is None:
        unavailable("redis-server is not installed")
    if bindir is None or not (bindir / "pg_ctl").exists():
        unavailable("PostgreSQL's server (initdb, pg_ctl) is not installed")
    if os.geteuid() == 0 and not shutil.which("runuser"):
        unavailable("running as root: PostgreSQL runs as the postgres user, and runuser is not installed")
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            unavailable("running as root: PostgreSQL runs as the postgres user, and there is none")
    # not under pytest's folder: the postgres user (when this runs as root) works in it
    folder = Path(tempfile.mkdtemp(prefix="specdec-fleet-"))
    folder.chmod(0o755)
    (folder / "redis").mkdir()
    (folder / "pg").mkdir()
    redis = PrivateRedis(redis_exe, folder / "redis", free_port())
    pg = PrivatePostgres(bindir, folder / "pg", free_port())
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        redis.start()
        stack.callback(lambda: redis.proc.poll() is None and redis.stop())
        pg.start()
        stack.callback(pg.stop_quietly)
        store.ensure_schema(pg.url)
        stack.callback(dispose_engine, pg.url)
        f = make_fleet(folder, redis.url, 0, pg.url, pairs_toml)
        f.env.update(LEASE)
        use(f)
        pace = paced_steps(folder, STEP_S)
        procs = [f.start_worker(f"w{i}", **pace) for i in range(3)]
        stack.callback(f.stop)
        started = time.monotonic()
        job = client.submit(write_prompts(folder / "rows.jsonl", ROWS, "fleet"), "tiny", ROW)["job_id"]
        recovery: dict[str, float] = {}
        failure: list[BaseException] = []

        def faults() -> None:
            try:
                # 1. SIGKILL a worker (its main process and pool child) while it holds a row
                until(lambda: (finished(job) or 0) >= ROWS // 20, 300, "the job did not start")
                victim, rows = None, []
                while not rows:
                    for p in procs:
                        rows = held_by(job, p.pid)
                        if rows:
                            victim = p
                            os.killpg(p.pid, signal.SIGKILL)
                            break
                    time.sleep(0.01)
                # its row comes back by its lease (the queue's backlog then decides when it runs)
                recovery["SIGKILL"] = until(lambda: all(back(r) for r in rows), 240, "the killed row")
                print(f"fleet: worker {victim.pid} SIGKILLed mid-row; its row back {recovery['SIGKILL']:.1f} s later")
                # 2. Redis stopped for OUTAGE_S, then started (its append-only file keeps the queue)
                until(lambda: (finished(job) or 0) >= ROWS // 5, 300, "no progress before the Redis stop")
                redis.stop()
                time.sleep(OUTAGE_S)
                redis.start()
                recovery["Redis restart"] = progress_after(job, "the Redis restart")
                # 3. PostgreSQL stopped for OUTAGE_S, then started
                until(lambda: (finished(job) or 0) >= ROWS * 7 // 20, 300, "no progress before the PostgreSQL stop")
                pg.stop()
                time.sleep(OUTAGE_S)
                pg.start()
                recovery["PostgreSQL restart"] = progress_after(job, "the PostgreSQL restart")
            except BaseException as e:  # noqa: BLE001 - the test fails with it below
                failure.append(e)

        thread = threading.Thread(target=faults, daemon=True)
        thread.start()
        counts = client.wait(job, workers=procs, requeue_lost_after_s=LEASE_S, timeout_s=900)
        thread.join(60)
        wall = time.monotonic() - started
        assert not failure, failure
        assert set(recovery) == {"SIGKILL", "Redis restart", "PostgreSQL restart"}, recovery
        assert counts["ok"] == ROWS, counts
        assert_exactly_once(job, ROWS)
        with store.session_scope() as s:
            again = s.scalar(select(func.count()).where(Request.job_id == job, Request.attempts > 1))
            requeued = s.scalar(select(func.sum(Request.requeues)).where(Request.job_id == job)) or 0
            tel = s.scalar(select(func.count()).select_from(Telemetry).where(Telemetry.job_id == job))
            distinct = s.scalar(select(func.count(func.distinct(Telemetry.request_id))).where(Telemetry.job_id == job))
        for fault, seconds in recovery.items():
            print(f"fleet: recovery after {fault}: {seconds:.1f} s")
        print(
            f"fleet: {ROWS} rows ok in {wall:.0f} s; rows delivered again {again} ({requeued} requeued by lease); "
            f"duplicates {tel - distinct}"
        )
        assert tel - distinct == 0
