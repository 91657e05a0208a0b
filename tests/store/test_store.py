"""The write side of the store, on SQLite files and on the PostgreSQL server."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import pytest
from conftest import empty_store
from sqlalchemy import func, inspect, select

from specdec_llm.engine.types import GenerationResult, Stats
from specdec_llm.settings import reload_settings
from specdec_llm.store import db, record
from specdec_llm.store.models import STATS_FIELDS, Baseline, Job, Output, Request, Telemetry, Worker


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path, sqlite_template):
    """An empty store at head: a fresh SQLite file, or the module's PostgreSQL database emptied."""
    u = empty_store(request, tmp_path, sqlite_template)
    yield u
    if request.param == "sqlite":
        db.dispose_engine(u)


def make_result(**stats) -> dict:
    base = dict(
        prompt_tokens=7,
        output_tokens=12,
        draft_tokens_proposed=16,
        draft_tokens_accepted=10,
        acceptance_rate=0.625,
        mean_accepted_length=3.0,
        per_position_acceptance=[0.9, 0.7, 0.5, 0.4],
        target_forwards=4,
        draft_forwards=16,
        draft_time_s=0.02,
        target_time_s=0.08,
        wall_time_s=0.12,
        time_to_first_token_s=0.03,
        tokens_per_s=100.0,
        k_values=[4, 4, 4, 4],
        finish_reason="length",
    )
    base.update(stats)
    return GenerationResult(
        text="hello world", token_ids=list(range(12)), finish_reason=base["finish_reason"], stats=Stats(**base)
    ).to_dict()


WORKER = {
    "host": "node1",
    "pid": 42,
    "device_name": "NVIDIA H200",
    "torch_version": "2.13.0",
    "transformers_version": "5.24.0",
}


def count(url, model) -> int:
    with db.session_scope(url) as s:
        return s.scalar(select(func.count()).select_from(model))


def test_every_stats_field_has_a_telemetry_column():
    columns = {c.name for c in Telemetry.__table__.columns}
    assert set(STATS_FIELDS) == {f.name for f in dataclasses.fields(Stats)}
    assert set(STATS_FIELDS) <= columns


def test_record_result_stores_every_field_once(url):
    result = make_result()
    kw = dict(worker=WORKER, device="cuda:0", queue_wait_s=0.5, pair="p", job_id=None, price_per_hour=3.6, url=url)
    assert record.record_result("r1", result, **kw) is True
    assert record.record_result("r1", make_result(output_tokens=99), **kw) is False  # a redelivery
    assert count(url, Output) == count(url, Telemetry) == count(url, Request) == 1
    with db.session_scope(url) as s:
        t = s.get(Telemetry, "r1")
        for name in STATS_FIELDS:
            assert getattr(t, name) == pytest.approx(result["stats"][name]), name
        assert (t.device, t.device_kind, t.queue_wait_s) == ("cuda:0", "cuda", 0.5)
        assert t.estimated_cost_usd == pytest.approx(0.12 / 3600 * 3.6)
        w = s.get(Worker, t.worker_id)
        assert (w.host, w.pid, w.device_name, w.torch_version) == ("node1", 42, "NVIDIA H200", "2.13.0")
    got = record.get_request("r1", url=url)
    assert got["status"] == "ok" and got["attempts"] == 1
    assert got["output"] == {
        "text": "hello world",
        "token_ids": list(range(12)),
        "finish_reason": "length",
        "prompt_tokens": 7,
        "output_tokens": 12,
    }


def test_concurrent_deliveries_write_one_row(url):
    record.upsert_pair("p", url=url)

    def deliver(_):
        return record.record_result(
            "dup",
            make_result(),
            worker=WORKER,
            device="cpu",
            queue_wait_s=None,
            pair="p",
            job_id=None,
            price_per_hour=None,
            url=url,
        )

    with ThreadPoolExecutor(6) as pool:
        wrote = list(pool.map(deliver, range(6)))
    assert wrote.count(True) == 1
    assert count(url, Telemetry) == count(url, Output) == 1
    with db.session_scope(url) as s:
        assert s.scalar(select(func.count()).select_from(Worker)) == 1


def test_a_job_whose_last_rows_finish_at_once_is_done(url):
    """Two workers record a job's last two rows at the same moment: each transaction locks the
    job's row before looking for pending rows, so the second sees the first's and ends the job
    (on PostgreSQL, READ COMMITTED, each saw the other's row still pending: the job stayed running)."""
    import threading

    record.upsert_pair("p", url=url)
    jobs = [f"race{j}" for j in range(30)]
    for job in jobs:
        record.create_job([{"id": f"{job}-1", "prompt": "p"}, {"id": f"{job}-2", "prompt": "p"}], job_id=job, url=url)
    barrier = threading.Barrier(2)

    def finish(request_id: str) -> None:
        job = request_id.rsplit("-", 1)[0]
        barrier.wait()
        record.record_result(
            request_id,
            make_result(),
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair="p",
            job_id=job,
            price_per_hour=None,
            url=url,
        )

    with ThreadPoolExecutor(2) as pool:
        for job in jobs:
            list(pool.map(finish, (f"{job}-1", f"{job}-2")))
    with db.session_scope(url) as s:
        states = dict(s.execute(select(Job.id, Job.status).where(Job.id.in_(jobs))).all())
    assert states == dict.fromkeys(jobs, "done")


def test_jobs_are_idempotent_on_idempotency_keys(url):
    items = [
        {"prompt": "a", "idempotency_key": "k-a", "category": "chat", "params": {"max_new_tokens": 8}},
        {"messages": [{"role": "user", "content": "b"}], "idempotency_key": "k-b"},
        "plain prompt",
    ]
    job = record.create_job(items, name="batch 1", pair="p", params={"temperature": 0}, url=url)
    assert job["created"] == 3 and len(set(job["request_ids"])) == 3
    again = record.create_job(items[:2], name="batch 1", job_id=job["job_id"], url=url)
    assert again["created"] == 0 and again["request_ids"] == job["request_ids"][:2]
    other = record.create_job(
        [{"prompt": "a", "idempotency_key": "k-a"}, {"prompt": "c", "idempotency_key": "k-c"}], url=url
    )
    assert other["request_ids"][0] == job["request_ids"][0] and other["created"] == 1
    info = record.get_job(job["job_id"], url=url)
    assert (info["status"], info["n_requests"], info["n_ok"], info["n_failed"]) == ("queued", 3, 0, 0)
    req = record.get_request(job["request_ids"][1], url=url)
    assert req["messages"] == [{"role": "user", "content": "b"}] and req["status"] == "queued"
    assert record.get_request(job["request_ids"][0], url=url)["params"] == {"max_new_tokens": 8}


def test_request_lifecycle_and_job_counts(url):
    job = record.create_job(["a", "b", "c"], pair="p", url=url)
    a, b, c = job["request_ids"]
    assert record.mark_request(a, "running", worker=WORKER, url=url)
    assert record.get_job(job["job_id"], url=url)["status"] == "running"
    assert record.mark_request(a, "queued", error="worker lost", url=url)  # a retry
    assert record.mark_request(a, "running", url=url)
    assert record.record_result(
        a,
        make_result(),
        worker=WORKER,
        device="cpu",
        queue_wait_s=1.0,
        pair="p",
        job_id=None,
        price_per_hour=None,
        url=url,
    )
    got = record.get_request(a, url=url)
    assert (got["status"], got["attempts"], got["error"]) == ("ok", 2, None)
    # a late failure from a duplicate delivery can't undo the result
    assert record.mark_request(a, "failed", error="late", url=url) is False
    assert record.get_request(a, url=url)["status"] == "ok"
    assert record.mark_request(b, "failed", error="CUDA out of memory", url=url)
    assert record.mark_request(c, "cancelled", url=url)
    info = record.get_job(job["job_id"], url=url)
    assert (info["status"], info["n_requests"], info["n_ok"], info["n_failed"]) == ("done", 3, 1, 1)
    assert info["finished_at"] is not None
    assert record.get_job(job["job_id"], url=url)["finished_at"] == info["finished_at"]
    assert record.get_request(b, url=url)["error"] == "CUDA out of memory"
    assert record.mark_request("no-such-request", "failed", url=url) is False
    with pytest.raises(ValueError, match="status must be"):
        record.mark_request(a, "ok", url=url)


def test_record_result_creates_missing_rows_and_keeps_the_job(url):
    """Direct engine use: no request row, job or pair beforehand."""
    assert record.record_result(
        "x1",
        make_result(),
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="new-pair",
        job_id="job-9",
        price_per_hour=None,
        category="code",
        url=url,
    )
    with db.session_scope(url) as s:
        t = s.get(Telemetry, "x1")
        assert (t.job_id, t.category, t.worker_id) == ("job-9", "code", None)
    info = record.get_job("job-9", url=url)
    assert (info["status"], info["n_ok"]) == ("done", 1)


def test_pairs_workers_and_baselines_upsert(url):
    pid = record.upsert_pair(
        "p",
        target="HuggingFaceTB/SmolLM2-135M",
        draft="layers:0",
        dtype="float32",
        device="cpu",
        target_fingerprint="abc",
        url=url,
    )
    assert record.upsert_pair("p", dtype="bfloat16", url=url) == pid  # partial update keeps the rest
    wid = record.upsert_worker(WORKER, url=url)
    assert record.upsert_worker({**WORKER, "torch_version": "2.14.0"}, url=url) == wid
    assert record.upsert_worker({**WORKER, "pid": 43}, url=url) != wid
    with db.session_scope(url) as s:
        assert s.get(Worker, wid).torch_version == "2.14.0"
        from specdec_llm.store.models import Pair

        p = s.get(Pair, pid)
        assert (p.target, p.dtype, p.target_fingerprint) == ("HuggingFaceTB/SmolLM2-135M", "bfloat16", "abc")
    b = record.record_baseline("p", device="cuda:0", dtype="bfloat16", tokens_per_s=50.0, url=url)
    assert (b["device_kind"], b["tokens_per_s"], b["source"]) == ("cuda", 50.0, "calibration")
    b = record.record_baseline("p", device="cuda:1", dtype="bfloat16", tokens_per_s=40.0, source="shadow", url=url)
    assert (b["tokens_per_s"], b["samples"], b["source"]) == (40.0, 1, "shadow")  # replaces calibration
    b = record.record_baseline(
        "p", device="cuda", dtype="bfloat16", tokens_per_s=60.0, source="shadow", samples=3, url=url
    )
    assert (b["tokens_per_s"], b["samples"]) == (pytest.approx(55.0), 4)  # (40*1 + 60*3) / 4
    b = record.record_baseline("p", device="cuda", dtype="bfloat16", tokens_per_s=45.0, url=url)
    assert (b["tokens_per_s"], b["samples"], b["source"]) == (45.0, 1, "calibration")
    assert count(url, Baseline) == 1
    with pytest.raises(ValueError):
        record.record_baseline("p", device="cpu", dtype="float32", tokens_per_s=0.0, url=url)


def test_worker_info_describes_this_process():
    info = record.worker_info("cpu")
    assert info["pid"] == os.getpid() and info["device_name"] == "cpu" and info["host"]
    assert info["torch_version"]  # installed in the test environment


def test_default_store_is_sqlite_in_the_data_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECDEC_DATABASE_URL", raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    try:
        record.upsert_pair("p")  # first use: creates the directory, the file, the tables
        path = tmp_path / "data" / "specdec.db"
        assert path.exists()
        assert db.current_revision() == db.head_revision()
        assert str(db.get_engine().url) == f"sqlite:///{path}"
    finally:
        db.dispose_engine()
        monkeypatch.delenv("SPECDEC_DATA_DIR")
        reload_settings()


def test_unreachable_database_is_one_line_without_the_password():
    url = "postgresql+psycopg://bob:s3cret@127.0.0.1:1/nowhere"
    with pytest.raises(db.StoreError) as e:
        record.upsert_pair("p", url=url)
    msg = str(e.value)
    assert "\n" not in msg and "s3cret" not in msg
    assert msg.startswith("cannot use the database at postgresql+psycopg://bob:***@127.0.0.1:1/nowhere (")
    assert msg.endswith("check SPECDEC_DATABASE_URL and that the server is running")
    db.dispose_engine(url)


@pytest.mark.parametrize("bad", ["not a url", "nosuchdb://x/y", "postgresql://u:s3cret@h:port:x/d"])
def test_bad_database_urls_are_one_line(bad):
    with pytest.raises(db.StoreError) as e:
        db.get_engine(bad)
    assert "\n" not in str(e.value) and "set SPECDEC_DATABASE_URL to" in str(e.value)
    assert "s3cret" not in str(e.value)


def test_mask_url():
    assert db.mask_url("postgresql+psycopg://u:pw@h:5432/d") == "postgresql+psycopg://u:***@h:5432/d"
    assert db.mask_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"
    # a password holding "@" (kombu reads it to the last "@"): none of it shown
    assert db.mask_userinfo("redis://:hunter2@topsecret@127.0.0.1:1/0") == "redis://:***@127.0.0.1:1/0"
    assert db.mask_url("postgresql://u:p@ss@db/x") == "postgresql://u:***@db/x"
    assert db.mask_userinfo("redis://h:6379/0?password=a@b") == "redis://h:6379/0?password=***"


def test_timestamps_are_naive_utc(url):
    record.record_result(
        "t1",
        make_result(),
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="p",
        job_id=None,
        price_per_hour=None,
        finished_at=datetime(2026, 3, 1, 12, 30),
        url=url,
    )
    with db.session_scope(url) as s:
        t = s.get(Telemetry, "t1")
        assert t.finished_at == datetime(2026, 3, 1, 12, 30) and t.finished_at.tzinfo is None


def test_schema_has_the_report_index(url):
    engine = db.get_engine(url)
    names = {ix["name"] for ix in inspect(engine).get_indexes("telemetry")}
    assert "ix_telemetry_report" in names


def test_a_cancelled_request_does_not_start_running(url):
    job = record.create_job([{"prompt": "a"}], name="j", pair="p", params={}, job_id="cancel-race", url=url)
    rid = job["request_ids"][0]
    assert record.mark_request(rid, "cancelled", url=url)
    assert not record.mark_request(rid, "running", url=url)
    assert record.get_request(rid, url=url)["status"] == "cancelled"
    assert record.mark_request(rid, "queued", url=url)  # retry re-queues it
    assert record.mark_request(rid, "running", url=url)


def test_rows_decoded_in_one_batch_share_its_device_time_and_cost(url):
    """4 rows decoded together for 10 s kept the device busy 10 s: 10 device-seconds and, at
    $1 a device-second, $10 (it was 40 and $40: each row charged its whole wall time)."""
    from specdec_llm.store import summary

    record.create_job([{"id": f"b{i}", "prompt": "p"} for i in range(5)], pair="p", job_id="batched", url=url)
    for i in range(5):  # b4: decoded alone, its batch size not recorded (a row from before 0002)
        stats = {"wall_time_s": 10.0, "output_tokens": 100, "batch_rows": 4.0 if i < 4 else None}
        record.record_result(
            f"b{i}",
            make_result(**stats),
            worker=WORKER,
            device="cuda:0",
            queue_wait_s=0.0,
            pair="p",
            job_id="batched",
            price_per_hour=3600.0,
            url=url,
        )
    [recorded] = summary(job="batched", group_by=(), url=url)
    assert recorded["device_seconds"] == pytest.approx(20.0) and recorded["cost_usd"] == pytest.approx(20.0)
    [priced] = summary(job="batched", group_by=(), price_per_hour="cuda=7200", url=url)
    assert priced["cost_usd"] == pytest.approx(40.0)
