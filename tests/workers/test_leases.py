"""Leases on running rows, and the job-wide store operations (no worker, no broker: fast).

The end-to-end cases (worker SIGKILLed mid-row, Redis restarted, `run`'s embedded worker
killed) are in tests/workers/test_faults.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update

from specdec_llm import store
from specdec_llm.store import jobs
from specdec_llm.store.models import Request, utcnow
from specdec_llm.store.testing import sqlite_url


@pytest.fixture
def url(tmp_path):
    u = sqlite_url(tmp_path)
    store.create_job(
        [{"id": f"r{i}", "prompt": f"p{i}", "params": {"_row": i}} for i in range(4)], pair="tiny", job_id="job", url=u
    )
    return u


def age(url: str, rid: str, seconds: float) -> None:
    """Pretend row ``rid``'s last heartbeat was ``seconds`` ago (its worker stopped beating)."""
    with store.session_scope(url) as s:
        s.execute(update(Request).where(Request.id == rid).values(heartbeat_at=utcnow() - timedelta(seconds=seconds)))


def test_a_live_lease_is_kept_an_expired_one_is_requeued_exactly_once(url):
    assert jobs.take("r0", "w1@h", lease_timeout_s=60, url=url)
    assert not jobs.take("r0", "w2@h", lease_timeout_s=60, url=url)  # a stale duplicate message: leave it
    assert jobs.take("r0", "w1@h", lease_timeout_s=60, url=url)  # its own worker (a redelivery) may
    assert jobs.renew(["r0", "r1"], "w1@h", url=url) == 1 and jobs.renew(["r0"], "w2@h", url=url) == 0
    assert jobs.reclaim(60, url=url) == []  # alive
    assert jobs.counts("job", lease_timeout_s=60, url=url)["lost"] == 0
    age(url, "r0", 61)
    assert jobs.counts("job", lease_timeout_s=60, url=url)["lost"] == 1
    assert jobs.reclaim(60, url=url) == [{"id": "r0", "pair": "tiny"}]
    assert jobs.reclaim(60, url=url) == []  # exactly once, whoever asks next
    row = store.get_request("r0", url=url)
    assert (row["status"], row["requeues"], row["lease_owner"]) == ("queued", 1, None)
    with store.session_scope(url) as s:  # an old row: its message was just sent again by reclaim's caller...
        s.execute(update(Request).where(Request.id == "r0").values(created_at=utcnow() - timedelta(seconds=120)))
    assert jobs.unsent("tiny", 60, url=url) == []  # ...so it is not sent a second time at once
    c = jobs.counts("job", lease_timeout_s=60, url=url)
    assert (c["queued"], c["running"], c["lost"], c["requeued"]) == (4, 0, 0, 1)
    assert jobs.take("r0", "w2@h", lease_timeout_s=60, url=url)  # another worker runs it now
    store.record_result(
        "r0",
        {"text": "x", "token_ids": [1], "stats": {}},
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="tiny",
        job_id="job",
        price_per_hour=None,
        url=url,
    )
    assert jobs.counts("job", lease_timeout_s=60, url=url)["requeued"] == 0  # done: no longer shown as lost
    assert not jobs.take("r0", "w1@h", lease_timeout_s=60, url=url)  # finished rows are never taken


def test_an_expired_lease_can_be_taken_over(url):
    assert jobs.take("r1", "w1@h", lease_timeout_s=60, url=url)
    age(url, "r1", 61)
    assert jobs.take("r1", "w2@h", lease_timeout_s=60, url=url)
    assert store.get_request("r1", url=url)["lease_owner"] == "w2@h"


def test_a_worker_out_of_retries_fails_only_a_row_that_is_still_its_own(url):
    """`GenerateTask.on_failure` (``held_by``): a row another worker took over, or one cancelled
    meanwhile, is not failed by the first worker giving up; its own running row and a queued
    one (it failed before taking it) are."""
    assert jobs.take("r0", "w1@h", lease_timeout_s=60, url=url)
    age(url, "r0", 61)
    assert jobs.take("r0", "w2@h", lease_timeout_s=60, url=url)  # taken over, running there
    assert jobs.take("r1", "w1@h", lease_timeout_s=60, url=url)
    store.mark_request("r2", "cancelled", error="cancelled", url=url)
    store.create_job([{"id": "r4", "prompt": "p4"}], pair="tiny", job_id="job", url=url)
    assert jobs.take("r4", "w1@h", lease_timeout_s=60, url=url)
    age(url, "r4", 61)
    assert [r["id"] for r in jobs.reclaim(60, url=url)] == ["r4"]  # requeued: its new message will take it
    for rid in ("r0", "r1", "r2", "r3", "r4"):
        store.mark_request(rid, "failed", error="RuntimeError: out of retries", held_by="w1@h", url=url)
    states = [store.get_request(rid, url=url)["status"] for rid in ("r0", "r1", "r2", "r3", "r4")]
    assert states == ["running", "failed", "cancelled", "failed", "queued"]


def test_a_row_whose_workers_keep_dying_fails(url):
    for n in range(3):
        assert jobs.take("r2", f"w{n}@h", lease_timeout_s=60, url=url)
        age(url, "r2", 61)
        assert [r["id"] for r in jobs.reclaim(60, max_attempts=3, url=url)] == ([] if n == 2 else ["r2"])
    row = store.get_request("r2", url=url)
    assert row["status"] == "failed" and "gave up after 3 attempts" in row["error"]
    assert [r["id"] for r in jobs.requeue("job", lease_timeout_s=60, url=url)] == ["r0", "r1", "r2", "r3"]
    with store.session_scope(url) as s:  # old rows, just sent by retry's caller: not sent again at once
        s.execute(update(Request).values(created_at=utcnow() - timedelta(seconds=120)))
    assert jobs.unsent("tiny", 60, url=url) == []
    assert jobs.take("r2", "w9@h", lease_timeout_s=60, url=url)  # a retry: its 3 attempts again, not 1
    age(url, "r2", 61)
    assert [r["id"] for r in jobs.reclaim(60, max_attempts=3, url=url)] == ["r2"]
    assert store.get_request("r2", url=url)["attempts"] == 1


def test_a_retry_keeps_a_lost_rows_attempt_count_which_its_stream_tells_attempts_by(url):
    """A row requeued by its lease, then `retry`: its next attempt is 2, so a stream's reader
    tells it from the lost one (an attempt 1 again gave "Hello worHello world")."""
    assert jobs.take("r0", "w1@h", lease_timeout_s=60, url=url)
    age(url, "r0", 61)
    assert [r["id"] for r in jobs.reclaim(60, url=url)] == ["r0"]
    assert "r0" in [r["id"] for r in jobs.requeue("job", lease_timeout_s=60, url=url)]
    assert jobs.take("r0", "w2@h", lease_timeout_s=60, url=url)
    assert store.get_request("r0", url=url)["attempts"] == 2


def test_requeue_and_cancel_are_one_statement_each(url):
    """retry: failed (not refused) and lost rows, never a row under a live lease; cancel: queued rows."""
    store.mark_request("r0", "failed", error="boom", url=url)
    with store.session_scope(url) as s:
        s.execute(update(Request).where(Request.id == "r3").values(params={"_row": 3, "_input_error": "line 4: bad"}))
    store.mark_request("r3", "failed", error="line 4: bad", url=url)
    assert jobs.take("r1", "w1@h", lease_timeout_s=60, url=url)  # alive
    assert sorted(r["id"] for r in jobs.requeue("job", lease_timeout_s=60, url=url)) == ["r0", "r2"]
    assert jobs.refused_count("job", url=url) == 1
    assert jobs.cancel("job", url=url) == 2  # r0, r2 (queued); r1 is running, r3 failed
    assert store.get_job("job", url=url)["status"] == "running"  # r1 still runs


def test_the_job_row_is_not_recounted_per_finished_row(url, monkeypatch):
    """A finished row costs index lookups, not a count over the job; the last one recounts."""
    from specdec_llm.store import record

    calls = []
    monkeypatch.setattr(record, "refresh_job", lambda s, job: calls.append(job))
    for i in range(3):
        store.record_result(
            f"r{i}",
            {"text": "x", "token_ids": [1], "stats": {}},
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair="tiny",
            job_id="job",
            price_per_hour=None,
            url=url,
        )
    assert calls == []  # before: one full recount per row
    store.record_result(
        "r3",
        {"text": "x", "token_ids": [1], "stats": {}},
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="tiny",
        job_id="job",
        price_per_hour=None,
        url=url,
    )
    assert calls == ["job"]
    monkeypatch.undo()
    job = store.get_job("job", url=url)
    assert (job["status"], job["n_ok"]) == ("done", 4)


def test_status_shows_lost_rows_instead_of_a_false_eta(url, monkeypatch):
    import typer
    from typer.testing import CliRunner

    from specdec_llm.client.cli import register
    from specdec_llm.settings import reload_settings

    cli = typer.Typer()
    register(cli)
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url)
    reload_settings()
    try:
        for rid in ("r0", "r1"):
            assert jobs.take(rid, "w1@h", lease_timeout_s=60, url=url)
        store.record_result(
            "r1",
            {"text": "x", "token_ids": [1], "stats": {}},
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair="tiny",
            job_id="job",
            price_per_hour=None,
            url=url,
        )
        age(url, "r0", 61)  # its worker was SIGKILLed a minute ago
        out = CliRunner().invoke(cli, ["status", "job"]).output
        assert "1 lost, being requeued" in out and "ETA - s" in out
        jobs.reclaim(60, url=url)
        out = CliRunner().invoke(cli, ["status", "job"]).output
        assert "1 lost, requeued" in out and "running 0" in out
    finally:
        monkeypatch.delenv("SPECDEC_DATABASE_URL")
        reload_settings()


def test_batch_server_cancel_drops_one_row_and_keeps_the_others():
    """``BatchServer.cancel``: a running row leaves the batch (CancelledError), the others
    finish with the same tokens as alone; a request not started never joins."""
    import time
    from concurrent.futures import CancelledError

    from conftest import greedy_reference, tiny_llama

    from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
    from specdec_llm.engine.serve import BatchServer

    target = tiny_llama(0)
    server = BatchServer(SpeculativeDecoder(target, tiny_llama(1, layers=1)), max_batch=4, max_wait_ms=50)
    try:
        long = server.submit(GenerationRequest(prompt=[5, 6, 7], max_new_tokens=500, k=0))
        short = server.submit(GenerationRequest(prompt=[3, 4], max_new_tokens=20, k=0))
        while not long.running():  # joined the batch (hundreds of steps to go)
            time.sleep(0.001)
        assert server.cancel(long)
        with pytest.raises(CancelledError):
            long.result(timeout=60)
        assert short.result(timeout=60).token_ids == greedy_reference(target, [3, 4], 20)
        assert not server.cancel(short)  # finished: nothing to cancel
    finally:
        server.close(timeout=10)


def test_a_row_lock_folder_others_can_write_is_not_trusted(tmp_path, monkeypatch, caplog):
    """A rows folder another user made (or any that others can write) could hold a lock on a
    row so this node drops the row's every message: it is refused, the store's lease alone
    guards the row, and the row is generated."""
    import fcntl
    import os

    from workers import tasks

    monkeypatch.setattr(tasks, "ROWS_DIR", tmp_path / "rows")
    (tmp_path / "rows").mkdir(mode=0o777)
    os.chmod(tmp_path / "rows", 0o777)  # (past the umask)
    path = tasks._lock_path("node", "r1")
    path.parent.mkdir()
    held = os.open(path, os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # someone else's lock on the row
    try:
        with tasks.generating_here("node", "r1") as mine:
            assert mine
        assert "not a folder of this user's that only it can write" in caplog.text
        os.chmod(tmp_path / "rows", 0o700)
        with tasks.generating_here("node", "r1") as mine:
            assert not mine  # (an own folder: the lock is honoured)
    finally:
        os.close(held)


def test_a_row_lock_is_per_store(tmp_path, monkeypatch):
    """Row ids are unique within a store only: a worker generating row "r1" of one store does
    not drop the messages of another store's "r1" on the same host (two deployments' workers,
    or two test processes, on one machine)."""
    from specdec_llm.settings import reload_settings
    from workers import tasks

    monkeypatch.setattr(tasks, "ROWS_DIR", tmp_path / "rows")
    monkeypatch.setenv("SPECDEC_DATABASE_URL", sqlite_url(tmp_path / "a"))
    reload_settings()
    with tasks.generating_here("node", "r1") as mine:
        assert mine
        with tasks.generating_here("node", "r1") as again:
            assert not again  # (the same store's row: the lock holds)
        monkeypatch.setenv("SPECDEC_DATABASE_URL", sqlite_url(tmp_path / "b"))
        reload_settings()
        with tasks.generating_here("node", "r1") as other:
            assert other
    reload_settings()
