"""Leases and worker liveness on one clock, the database's: hosts sharing a PostgreSQL store
whose own clocks disagree neither take over each other's live rows nor keep a dead worker's
rows forever. (A SQLite store lives on one host: its clock is the database's.)

A "host" here is this process with the store's Python clock (``utcnow``, in every store
module) moved by an offset; the database, on this machine, keeps the real time."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import pytest
from conftest import empty_store
from sqlalchemy import update

from specdec_llm import store
from specdec_llm.store import admin, db, jobs
from specdec_llm.store.models import Request, Worker, utcnow

SKEW = timedelta(minutes=10)
LEASE_S = 60
WORKER = {"host": "gpu-a", "pid": 7, "device_name": "cpu"}


@pytest.fixture(params=["postgresql"])
def url(request, tmp_path, sqlite_template):
    u = empty_store(request, tmp_path, sqlite_template)
    store.create_job(
        [{"id": f"r{i}", "prompt": f"p{i}", "params": {"_row": i}} for i in range(3)], pair="tiny", job_id="job", url=u
    )
    return u


def real_now() -> datetime:
    """The database's clock (it runs on this machine), whatever a test did to the store's."""
    return datetime.now(UTC).replace(tzinfo=None)


@contextmanager
def host(offset: timedelta) -> Iterator[None]:
    """Calls made meanwhile come from a host whose clock is ``offset`` off the database's."""
    with pytest.MonkeyPatch.context() as mp:
        for name, module in list(sys.modules.items()):
            if name.startswith("specdec_llm.store") and getattr(module, "utcnow", None) is utcnow:
                mp.setattr(module, "utcnow", lambda: real_now() + offset)
        yield


def age(url: str, rid: str, seconds: float) -> None:
    """Row ``rid``'s last heartbeat was ``seconds`` ago, in the database's time."""
    with store.session_scope(url) as s:
        s.execute(update(Request).where(Request.id == rid).values(heartbeat_at=real_now() - timedelta(seconds=seconds)))


def beat(worker: dict, url: str) -> None:
    kw = dict(pair="tiny", dtype="float32", max_batch=1, rows_done=0, output_tokens=0, tokens_per_s=None, url=url)
    admin.heartbeat_worker(worker, **kw)


def stale(url: str) -> dict[int, bool]:
    return {w["pid"]: w["stale"] for w in admin.list_workers(stale_after_s=LEASE_S, url=url)}


@pytest.mark.parametrize("offset", [SKEW, -SKEW], ids=["ahead", "behind"])
def test_a_live_lease_is_kept_whatever_the_callers_clock_says(url, offset):
    """A row leased and heartbeated on one host is neither requeued, retried, counted lost nor
    taken over by a call from a host whose clock is 10 minutes off; nor a worker marked stale."""
    with host(-offset):  # the worker's host (its clock off the other way: 20 minutes apart)
        assert jobs.take("r0", "w1@a", lease_timeout_s=LEASE_S, url=url)
        assert jobs.renew(["r0"], "w1@a", url=url) == 1
        beat(WORKER, url)
    with host(offset):
        assert jobs.reclaim(LEASE_S, max_attempts=3, url=url) == []
        assert not jobs.take("r0", "w2@b", lease_timeout_s=LEASE_S, url=url)
        assert jobs.counts("job", lease_timeout_s=LEASE_S, url=url)["lost"] == 0
        assert "r0" not in {r["id"] for r in jobs.requeue("job", lease_timeout_s=LEASE_S, url=url)}
        assert jobs.unsent("tiny", LEASE_S, url=url) == []  # rows just submitted (and just sent again)
        assert stale(url) == {7: False}
    row = store.get_request("r0", url=url)
    assert (row["status"], row["lease_owner"], row["attempts"], row["requeues"]) == ("running", "w1@a", 1, 0)


@pytest.mark.parametrize("offset", [SKEW, -SKEW], ids=["ahead", "behind"])
def test_a_dead_workers_lease_expires_by_the_databases_clock(url, offset):
    """No heartbeat for longer than the lease timeout, in the database's time: a host whose clock
    is 10 minutes off counts the row lost, requeues it (or takes it over) and marks the worker
    stale; a row beaten 30 s ago is left alone."""
    for rid in ("r0", "r1", "r2"):
        assert jobs.take(rid, "w1@a", lease_timeout_s=LEASE_S, url=url)
    beat(WORKER, url)
    age(url, "r0", LEASE_S + 5)
    age(url, "r1", LEASE_S + 5)
    age(url, "r2", 30)
    with store.session_scope(url) as s:
        s.execute(update(Worker).values(heartbeat_at=real_now() - timedelta(seconds=LEASE_S + 5)))
    with host(offset):
        assert jobs.counts("job", lease_timeout_s=LEASE_S, url=url)["lost"] == 2
        assert stale(url) == {7: True}
        assert jobs.take("r1", "w2@b", lease_timeout_s=LEASE_S, url=url)  # a redelivered message
        assert jobs.reclaim(LEASE_S, url=url) == [{"id": "r0", "pair": "tiny"}]
    assert [store.get_request(r, url=url)["lease_owner"] for r in ("r0", "r1", "r2")] == [None, "w2@b", "w1@a"]


def test_a_hold_is_kept_whatever_the_pruning_hosts_clock_says(url):
    """``run`` holds its job on one host; ``prune`` on a host 10 minutes ahead leaves it."""
    for rid in ("r0", "r1", "r2"):
        store.mark_request(rid, "cancelled", error="cancelled", url=url)
    assert store.hold_job("job", 60, url=url)
    with host(SKEW):
        plan = admin.prune_plan(real_now() + timedelta(days=1), url=url)
        assert (plan["jobs"], plan["held"]) == (0, 1)
        assert admin.prune(real_now() + timedelta(days=1), url=url)["jobs"] == 0
    assert store.get_job("job", url=url) is not None


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request, tmp_path, sqlite_template):
    u = empty_store(request, tmp_path, sqlite_template)
    yield u
    if request.param == "sqlite":
        db.dispose_engine(u)


def test_db_now_is_the_databases_utc_time(any_store):
    """The store's one clock for leases: naive UTC, the database server's (SQLite: this host's)."""
    from specdec_llm.store.sql import db_now

    with store.session_scope(any_store) as s:
        t = db_now(s)
    assert t.tzinfo is None and abs((t - real_now()).total_seconds()) < 5
