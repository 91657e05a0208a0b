"""Operating bulk jobs (#34) without a worker: `jobs`, `workers`, `prune`, `results
--failed-only`, `cancel --now` and `status --watch` against SQLite and PostgreSQL stores, bad
input (one line, exit 2), and the engine's per-row stop hook. The same commands with real
workers: tests/workers/test_operating_workers.py."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta

import pytest
from conftest import greedy_reference, process_store, tiny_llama
from sqlalchemy import func, select, update
from typer.testing import CliRunner

from specdec_llm import client, store
from specdec_llm.engine import RequestError
from specdec_llm.store import admin, jobs
from specdec_llm.store.models import Job, Output, Request, Telemetry, Worker, utcnow


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path, sqlite_template, monkeypatch):
    yield from process_store(request, tmp_path, sqlite_template, monkeypatch)


def cli(*args, input: str | None = None):
    from specdec_llm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def one_line_exit_2(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and fragment in err, err


def fits_80(output: str) -> None:
    assert output.strip() and max(len(line) for line in output.splitlines()) <= 80, output


RESULT = {"text": "hello", "token_ids": [1, 2, 3], "finish_reason": "length", "stats": {"output_tokens": 10}}


def make_job(url, job_id, *, name="job", ok=0, failed=0, queued=0, age=timedelta(0)):
    """A job of ``ok`` finished, ``failed`` and ``queued`` rows, created ``age`` ago."""
    n = ok + failed + queued
    rows = [{"id": f"{job_id}-{i}", "prompt": f"p{i}", "params": {"_row": i, "_id": str(i)}} for i in range(n)]
    store.create_job(rows, name=name, pair="tiny", job_id=job_id, url=url)
    for i in range(ok):
        stats = {**RESULT["stats"], "wall_time_s": 0.5}
        store.record_result(
            f"{job_id}-{i}",
            {**RESULT, "stats": stats},
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair="tiny",
            job_id=job_id,
            price_per_hour=None,
            url=url,
        )
    for i in range(ok, ok + failed):
        store.mark_request(f"{job_id}-{i}", "failed", error="boom", url=url)
    with store.session_scope(url) as s:
        then = utcnow() - age
        done = (ok or failed) and not queued
        s.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(
                created_at=then,
                started_at=then if ok or failed else None,
                finished_at=then + timedelta(minutes=1) if done else None,
            )
        )
    store.get_job(job_id, url=url)  # the counters recounted


# -- jobs --------------------------------------------------------------------------------------
def test_jobs_lists_newest_first_with_rows_by_state_and_filters(url):
    make_job(url, "old", name="weekly", ok=2, failed=1, age=timedelta(days=3))
    make_job(url, "mid", name="adhoc", ok=1, queued=2, age=timedelta(hours=1))
    make_job(url, "new", name="nightly-2", queued=3)

    def listed(*args):
        r = cli("jobs", "--json", *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    rows = listed()
    assert [j["id"] for j in rows] == ["new", "mid", "old"]
    old = rows[2]
    assert (old["state"], old["ok"], old["failed"], old["pending"], old["rows"], old["pair"]) == (
        "done",
        2,
        1,
        0,
        3,
        "tiny",
    )
    assert old["output_tokens"] == 20 and old["tokens_per_s"] > 0 and old["age_s"] > 3 * 86400 - 60
    assert (rows[1]["state"], rows[1]["ok"], rows[1]["pending"]) == ("running", 1, 2)
    assert (rows[0]["state"], rows[0]["pending"], rows[0]["tokens_per_s"]) == ("queued", 3, None)
    assert [j["id"] for j in listed("--state", "done")] == ["old"]
    assert [j["id"] for j in listed("--name", "night")] == ["new"]
    assert [j["id"] for j in listed("--since", "2h")] == ["new", "mid"]
    assert [j["id"] for j in listed("--since", (utcnow() - timedelta(days=4)).date().isoformat())] == [
        "new",
        "mid",
        "old",
    ]
    assert [j["id"] for j in listed("--limit", "1")] == ["new"]
    table = cli("jobs")
    assert table.exit_code == 0, table.output
    fits_80(table.stdout)
    lines = table.stdout.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["new", "mid", "old"]
    assert "2/1/0" in lines[4] and "3d" in lines[4] and "done" in lines[4]
    assert "no jobs match" in cli("jobs", "--state", "running", "--name", "zzz").stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["jobs", "--state", "finished"], "state: 'finished' unknown; use --state queued"),
        (["jobs", "--since", "yesterday"], "--since: cannot read 'yesterday'"),
        (["jobs", "--limit", "0"], "limit: 0 shows nothing; use --limit 1 or more"),
        (["workers", "--since", "soon"], "--since: cannot read 'soon'"),
        (["prune"], "older-than: say how old"),
        (["prune", "--older-than", "ages"], "--older-than: cannot read 'ages'"),
        (["prune", "--older-than", "2999-01-01"], "older-than: '2999-01-01' is in the future"),
        (["prune", "--older-than", "1d", "--job", "nosuchjob"], "no job 'nosuchjob'"),
        (["status", "nosuchjob", "--watch"], "no job 'nosuchjob'"),
        (["status", "{job}", "--watch", "--interval", "0"], "interval: 0 s; use a number of seconds above 0"),
        (["status", "{job}", "--watch", "--interval", "inf"], "interval: inf s; use a number of seconds above 0"),
        (["status", "{job}", "--interval", "0"], "interval: 0 s between looks asks for --watch; add it"),
        (["results", "nosuchjob", "--failed-only"], "no job 'nosuchjob'"),
        (["cancel", "nosuchjob", "--now"], "no job 'nosuchjob'"),
    ],
)
def test_bad_input_is_one_line_naming_the_option_and_exit_2(url, args, fragment):
    make_job(url, "j1", queued=1)
    one_line_exit_2(cli(*[a.format(job="j1") for a in args]), fragment)


# -- workers -----------------------------------------------------------------------------------
def test_workers_lists_heartbeats_newest_first_and_marks_stale_ones(url):
    beat = dict(pair="tiny", dtype="float32", rows_done=0, output_tokens=0, tokens_per_s=None, url=url)
    admin.heartbeat_worker({"host": "gone-host", "pid": 11, "device_name": "cpu"}, max_batch=1, **beat)
    admin.heartbeat_worker({"host": "gpu-host", "pid": 22, "device_name": "cuda:0"}, max_batch=8, **beat)
    with store.session_scope(url) as s:  # the first one stopped beating ten minutes ago
        s.execute(update(Worker).where(Worker.pid == 11).values(heartbeat_at=utcnow() - timedelta(minutes=10)))
    store.upsert_worker({"host": "old-host", "pid": 33, "device_name": "cpu"}, url=url)  # no heartbeat: not listed
    beat.update(rows_done=7, output_tokens=700, tokens_per_s=12.5)
    admin.heartbeat_worker({"host": "gpu-host", "pid": 22, "device_name": "cuda:0"}, max_batch=8, **beat)
    r = cli("workers", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert [(w["host"], w["pid"], w["stale"]) for w in rows] == [("gpu-host", 22, False), ("gone-host", 11, True)]
    gpu = rows[0]
    assert (gpu["pair"], gpu["device"], gpu["dtype"], gpu["max_batch"]) == ("tiny", "cuda:0", "float32", 8)
    assert (gpu["rows_done"], gpu["output_tokens"], gpu["tokens_per_s"]) == (7, 700, 12.5)
    assert [w["pid"] for w in json.loads(cli("workers", "--json", "--since", "5m").stdout)] == [22]
    table = cli("workers")
    assert table.exit_code == 0, table.output
    fits_80(table.stdout)
    assert "stale" in table.stdout.splitlines()[3] and "live" in table.stdout.splitlines()[2]
    assert "12.5" in table.stdout and "SPECDEC_LEASE_TIMEOUT_S" in table.stdout


# -- prune -------------------------------------------------------------------------------------
def _count(url, model, *where) -> int:
    with store.session_scope(url) as s:
        return s.scalar(select(func.count()).select_from(model).where(*where)) or 0


def test_prune_deletes_old_finished_jobs_in_batches_and_keeps_the_rest(url, monkeypatch):
    make_job(url, "old1", ok=3, age=timedelta(days=3))
    make_job(url, "old2", ok=5, failed=2, age=timedelta(days=5))
    make_job(url, "oldrun", ok=1, queued=2, age=timedelta(days=4))  # unfinished: kept
    make_job(url, "recent", ok=2, age=timedelta(hours=1))
    make_job(url, "lc-reused", ok=2, age=timedelta(days=40))  # a LangChain job_name first used 40 days ago...
    with store.session_scope(url) as s:  # ...and last an hour ago: kept (its whole history went)
        s.execute(update(Job).where(Job.id == "lc-reused").values(finished_at=utcnow() - timedelta(hours=1)))
    declined = cli("prune", "--older-than", "2d", input="n\n")
    assert declined.exit_code == 1 and "nothing deleted" in declined.stdout
    assert "delete 2 finished jobs last used before" in declined.stdout and "their 10 rows" in declined.stdout
    assert _count(url, Job) == 5 and _count(url, Request) == 17
    monkeypatch.setattr(admin, "PRUNE_BATCH", 4)  # several transactions
    r = cli("prune", "--older-than", "2d", "--yes")
    assert r.exit_code == 0, r.output
    assert "freed 2 jobs, 10 rows, 8 outputs and 8 telemetry rows (1 older jobs still have rows to run" in r.stdout
    assert len(r.stderr.strip().splitlines()) >= 3  # a line per transaction
    assert {j["id"] for j in admin.list_jobs(limit=10)} == {"oldrun", "recent", "lc-reused"}
    assert _count(url, Request) == 7 and _count(url, Output) == 5 and _count(url, Telemetry) == 5
    assert "nothing to prune" in cli("prune", "--older-than", "2d", "--yes").stdout
    r = cli("prune", "--older-than", "0m", "--job", "recent", input="y\n")
    assert r.exit_code == 0 and "freed 1 jobs, 2 rows" in r.stdout, r.output
    assert {j["id"] for j in admin.list_jobs(limit=10)} == {"oldrun", "lc-reused"}


def test_a_job_prune_has_claimed_is_deleted_whole_whatever_comes_meanwhile(url):
    """A retry, a resubmission or new rows between two of prune's transactions are refused (the
    retry used to requeue what was left, a job keeping 7 of its 12 rows); a prune cut short
    is finished by the next one; a job left with no rows is done, not queued forever."""
    make_job(url, "old", ok=4, failed=8, age=timedelta(days=40))
    seen = []

    def meanwhile(freed):
        seen.append(freed["rows"])
        if len(seen) == 1:
            with pytest.raises(store.StoreError, match="job old is being deleted by `specdec-llm prune`"):
                client.retry("old")
            with pytest.raises(store.StoreError, match="being deleted"):
                store.create_job(["again"], job_id="old")
            raise KeyboardInterrupt  # the prune is cut short here

    with pytest.raises(KeyboardInterrupt):
        admin.prune(utcnow() - timedelta(days=2), batch_rows=5, on_batch=meanwhile)
    assert seen == [5] and _count(url, Request) == 7  # its first transaction's rows went
    assert store.get_job("old")["status"] == "done"
    assert admin.prune_plan(utcnow() - timedelta(days=400))["jobs"] == 1  # claimed: whatever its age
    assert admin.prune(utcnow() - timedelta(days=400))["jobs"] == 1
    assert _count(url, Request) == 0 and _count(url, Job) == 0
    assert store.create_job(["a new job of the same id"], job_id="old")["created"] == 1  # once gone
    empty = store.create_job([], job_id="empty")
    assert store.get_job(empty["job_id"])["status"] == "done"


# -- results --failed-only ------------------------------------------------------------------------
def test_results_failed_only_exports_the_failed_rows_in_input_order(url):
    make_job(url, "mixed", ok=2, failed=2)
    r = cli("results", "mixed", "--failed-only")
    assert r.exit_code == 0, r.output
    items = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(i["id"], i["status"], i["error"]) for i in items] == [("2", "failed", "boom"), ("3", "failed", "boom")]
    assert len(cli("results", "mixed").stdout.splitlines()) == 4


# -- cancel --now, the store's side -------------------------------------------------------------
def test_cancel_now_flags_the_job_keeps_partial_text_and_retry_runs_the_rows_again(url, pairs_file):
    make_job(url, "cn", queued=3)
    assert jobs.take("cn-0", "w1@h", lease_timeout_s=60, url=url)  # a worker is generating row 0
    r = cli("cancel", "cn", "--now")
    assert r.exit_code == 0, r.output
    assert "2 rows cancelled; 1 running rows stop at their next iteration" in r.stdout
    assert jobs.cancels_requested(["cn", "other"], url=url) == {"cn"}
    partial = {"text": "half a sen", "token_ids": [5, 6], "finish_reason": "cancelled", "stats": {"output_tokens": 2}}
    assert jobs.end_cancelled("cn-0", partial, url=url)
    assert not jobs.end_cancelled("cn-0", partial, url=url)  # once
    [row, *_] = client.results("cn")
    assert (row["status"], row["text"], row["finish_reason"]) == ("cancelled", "half a sen", "cancelled")
    assert "after 2 tokens" in row["error"] and _count(url, Telemetry) == 0  # reports count finished rows only
    assert store.get_job("cn")["status"] == "done"
    listed = admin.list_jobs()[0]
    assert listed["cancel_requested"] and listed["cancelled"] == 3
    again = client.retry("cn", cancelled=True)
    assert again["enqueued"] == 3 and jobs.cancels_requested(["cn"], url=url) == set()
    assert _count(url, Output) == 0  # the partial text goes: the new result takes its place


def test_rows_added_after_a_cancel_now_has_ended_are_not_stopped_by_it(url):
    """A LangChain job_name's job is used again by each call: a `cancel --now` of one call's rows
    left the job's flag set, and every later call's row stopped at its first step. Rows added
    while the cancel is still stopping rows are cancelled with them."""
    make_job(url, "agent", queued=1)
    assert jobs.take("agent-0", "w1@h", lease_timeout_s=60, url=url)
    jobs.cancel("agent", now=True, url=url)
    store.create_job([{"id": "during", "prompt": "p"}], job_id="agent", url=url)  # still stopping agent-0
    assert jobs.start("during", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)["cancel_requested_at"]
    partial = {"text": "", "token_ids": [], "finish_reason": "cancelled", "stats": {"output_tokens": 0}}
    for rid in ("agent-0", "during"):
        assert jobs.end_cancelled(rid, partial, url=url)
    store.create_job([{"id": "later", "prompt": "p"}], job_id="agent", url=url)  # the next call
    row = jobs.start("later", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)
    assert row["taken"] and row["cancel_requested_at"] is None
    assert jobs.cancels_requested(["agent"], url=url) == set()


@pytest.mark.parametrize("now", [True, False])
def test_a_lost_row_of_a_cancelled_job_is_cancelled_not_requeued(url, now):
    """Without --now, running rows finish; one whose worker is lost is not run again after the
    cancel (it was requeued and generated, the job running again). A retry runs it again."""
    make_job(url, "lostcn", queued=2)
    assert jobs.take("lostcn-0", "w1@h", lease_timeout_s=60, url=url)
    jobs.cancel("lostcn", now=now, url=url)
    store.create_job([{"id": "late", "prompt": "p"}], job_id="lostcn", url=url)  # (a row added since)
    assert jobs.take("late", "w1@h", lease_timeout_s=60, url=url)
    with store.session_scope(url) as s:
        s.execute(update(Request).where(Request.status == "running").values(heartbeat_at=utcnow() - timedelta(hours=1)))
    # the row added since runs again unless the cancel stops rows as they come (--now, until it ends)
    assert [r["id"] for r in jobs.reclaim(60, url=url)] == ([] if now else ["late"])
    assert store.get_request("lostcn-0", url=url)["status"] == "cancelled"
    if not now:
        assert jobs.take("late", "w2@h", lease_timeout_s=60, url=url)
        store.mark_request("late", "failed", error="boom", url=url)
    assert store.get_job("lostcn")["status"] == "done"
    assert len(jobs.requeue("lostcn", lease_timeout_s=60, cancelled=True, url=url)) == 3  # `retry --cancelled`
    assert jobs.take("lostcn-0", "w2@h", lease_timeout_s=60, url=url)
    with store.session_scope(url) as s:
        s.execute(update(Request).where(Request.id == "lostcn-0").values(heartbeat_at=utcnow() - timedelta(hours=1)))
    assert [r["id"] for r in jobs.reclaim(60, url=url)] == ["lostcn-0"]  # retried: requeued as any row


# -- status --watch ------------------------------------------------------------------------------
def test_status_watch_ends_with_the_job_and_ctrl_c_leaves_it_running(url, monkeypatch):
    from specdec_llm.client import ops_cli

    make_job(url, "w", queued=2)
    finished = []

    def pause(seconds):  # the second look finds row 0 done, the third the job done
        finished.append(seconds)
        store.record_result(
            f"w-{len(finished) - 1}",
            RESULT,
            worker=None,
            device="cpu",
            queue_wait_s=None,
            pair="tiny",
            job_id="w",
            price_per_hour=None,
        )

    monkeypatch.setattr(ops_cli, "_pause", pause)
    r = cli("status", "w", "--watch", "--interval", "0.5")
    assert r.exit_code == 0, r.output
    assert finished == [0.5, 0.5] and "job w: done: 2 ok, 0 failed, 0 cancelled" in r.stdout
    assert "2/2 rows (100%)" in r.stdout and "tok/s" in r.stdout
    looks = cli("status", "w", "--watch", "--json")
    assert looks.exit_code == 0 and json.loads(looks.stdout.splitlines()[0])["status"] == "done"

    make_job(url, "w2", queued=1)

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(ops_cli, "_pause", interrupt)
    r = cli("status", "w2", "--watch")
    assert r.exit_code == 0, r.output
    assert "stopped watching; job w2 keeps running" in r.stdout
    assert client.job_counts("w2")["queued"] == 1


# -- the engine: a row told to stop -------------------------------------------------------------
def test_a_row_told_to_stop_ends_with_its_partial_result_and_the_batch_goes_on():
    from specdec_llm.engine import GenerationRequest, SpeculativeDecoder
    from specdec_llm.engine.serve import BatchServer

    target = tiny_llama(0)
    server = BatchServer(SpeculativeDecoder(target), max_batch=4, max_wait_ms=200)
    looks = itertools.count()

    def broken():
        raise RuntimeError("a check that fails")

    try:
        a = server.submit(GenerationRequest([5, 6, 7], max_new_tokens=60, k=0), stop=lambda: next(looks) >= 6)
        b = server.submit(GenerationRequest([9, 8], max_new_tokens=60, k=0), stop=broken)
        ra, rb = a.result(timeout=120), b.result(timeout=120)
    finally:
        server.close(timeout=10)
    assert ra.finish_reason == "cancelled" and 0 < len(ra.token_ids) < 60
    assert ra.token_ids == greedy_reference(target, [5, 6, 7], len(ra.token_ids))  # what it had, exactly
    assert ra.stats.output_tokens == len(ra.token_ids) and ra.stats.finish_reason == "cancelled"
    assert rb.finish_reason == "length" and rb.token_ids == greedy_reference(target, [9, 8], 60)
    assert rb.stats.batch_rows < 2  # it went on alone after the other row stopped


def test_a_worker_reads_a_cancel_flag_when_told_and_forgets_it_after_a_retry(url):
    import time

    from workers.cancels import CancelFlags, announce

    make_job(url, "fl", queued=2)
    flags = CancelFlags()
    check = flags.watch(("fl",))
    assert not check()
    jobs.cancel("fl", now=True, url=url)
    time.sleep(0.3)
    assert not check()  # not told yet: no worker polls the store
    announce()  # the broadcast (or the lease heartbeat) tells this worker's processes
    deadline = time.monotonic() + 10
    while not check() and time.monotonic() < deadline:  # the next step asks; one read for all its jobs
        time.sleep(0.02)
    assert check()
    flags.release(("fl",))
    jobs.requeue("fl", lease_timeout_s=60, cancelled=True, url=url)  # `retry --cancelled` clears the flag
    assert not flags.watch(("fl",))()  # a new row of the job: not stopped by what an earlier look said
    flags.release(("fl",))
    jobs.cancel("fl", now=True, url=url)  # a row taken after the cancel (its job's flag read with it)
    assert flags.watch(("fl",), jobs.cancel_times(["fl"], url=url))()
    flags.release(("fl",))


def test_a_broadcast_naming_its_job_stops_the_row_at_the_next_step_without_a_store_read(url):
    """The broadcast carries the job and its flag's time: the row's next stop check says yes
    (the store has never heard of these jobs: nothing was read). An announcement from before a
    row of its job was taken (a retried job's old cancel) does not stop it: the looker asks the
    store, which holds no flag."""
    import time

    from specdec_llm.store import utcnow
    from workers.cancels import SLOTS, CancelFlags, announce

    flags = CancelFlags()
    stale = utcnow()
    announce("old-job", stale)
    check = flags.watch(("new-job",))
    old = flags.watch(("old-job",))
    assert not check() and not old()
    written = utcnow()
    announce("new-job", written)
    assert check() and check.iterations_after == 1  # the step running when it was written
    time.sleep(0.3)  # (the looker, woken by the stale announcement, found no flag: the store has no such job)
    assert not old()
    for i in range(SLOTS + 1):  # more at once than the ring holds: the looker reads the store
        announce(f"other-{i}", written)
    assert not old()
    flags.release(("new-job",)), flags.release(("old-job",))


def test_a_task_takes_and_reads_its_row_in_one_go_and_the_lease_heartbeat_reads_cancel_flags(url):
    make_job(url, "st", ok=1, queued=2)
    row = jobs.start("st-1", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)
    assert (row["taken"], row["status"], row["attempts"], row["prompt"]) == (True, "running", 1, "p1")
    assert row["job_id"] == "st" and row["cancel_requested_at"] is None and row["output"] is None
    other = jobs.start("st-1", "w2@h", lease_timeout_s=60, max_attempts=3, url=url)  # another worker's live lease
    assert (other["taken"], other["status"]) == (False, "running")
    done = jobs.start("st-0", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)  # finished: left alone
    assert (done["taken"], done["status"], done["output"]["text"]) == (False, "ok", RESULT["text"])
    assert jobs.start("nope", "w1@h", lease_timeout_s=60, max_attempts=3, url=url) is None
    assert jobs.renew_leases(["st-1"], "w1@h", url=url) == {}
    jobs.cancel("st", now=True, url=url)
    assert set(jobs.renew_leases(["st-1", "st-2"], "w1@h", url=url)) == {"st"}  # st-2: cancelled, not held
    assert jobs.renew_leases(["st-1"], "w2@h", url=url) == {}  # not w2's row
    again = jobs.start("st-1", "w1@h", lease_timeout_s=60, max_attempts=1, url=url)  # its own lease, out of attempts
    assert (again["taken"], again["attempts"]) == (False, 1) and again["cancel_requested_at"] is not None


def test_one_row_cancelled_alone_stops_at_its_next_step_and_its_job_goes_on(url):
    """``cancel_request``: a queued row is cancelled now; a running one gets its own flag, which
    its worker learns from a broadcast naming the row, its lease heartbeat or its looker's read,
    and it ends cancelled, its partial text kept; the job's other rows are left alone; a retry
    clears the flag; a lost row with the flag is not run again."""
    import time

    from workers.cancels import CancelFlags, announce

    make_job(url, "one", queued=4)
    assert jobs.cancel_request("one-0", url=url) == "cancelled"  # queued: now
    assert jobs.start("one-1", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)["cancel_requested_at"] is None
    jobs.start("one-2", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)
    flags = CancelFlags()
    mine, other = flags.watch(("one", "one-1")), flags.watch(("one", "one-2"))
    written = utcnow()
    assert jobs.cancel_request("one-1", at=written, url=url) == "stopping"
    assert jobs.renew_leases(["one-1", "one-2"], "w1@h", url=url) == {"one-1": written}  # the heartbeat's read
    assert jobs.cancel_times(["one", "one-1", "one-2"], url=url) == {"one-1": written}  # the looker's
    taken = jobs.start("one-1", "w1@h", lease_timeout_s=60, max_attempts=3, url=url)  # (a redelivery)
    assert (taken["row_cancel_requested_at"], taken["cancel_requested_at"]) == (written, None)  # its own, not its job's
    assert not mine() and not other()
    again = CancelFlags()  # a process taking it now: the flag stops that row, not the job's others
    row_stop = again.watch(("one", "one-1"), {"one": None, "one-1": taken["row_cancel_requested_at"]})
    assert row_stop() and not again.watch(("one", "one-2"))()
    again.release(("one", "one-1")), again.release(("one", "one-2"))
    assert again.flagged == {}  # (a released row's flag is forgotten: a long-lived worker does not grow)
    announce("one-1", written)  # the broadcast, naming the row
    assert mine() and not other()
    assert jobs.end_cancelled("one-1", {**RESULT, "stats": {}}, url=url)
    [row] = [r for r in jobs.job_requests("one", url=url) if r["id"] == "one-1"]
    assert row["status"] == "cancelled" and "its caller cancelled it" in row["error"] and row["text"] == RESULT["text"]
    assert jobs.counts("one", url=url)["running"] == 1 and jobs.cancel_times(["one"], url=url) == {}  # not its job
    announce()  # (a heartbeat's announcement: the looker reads the store, which names no other row)
    time.sleep(0.3)
    assert not other()
    flags.release(("one", "one-1")), flags.release(("one", "one-2"))
    assert jobs.cancel_request("one-1", url=url) == "cancelled" and jobs.cancel_request("nope", url=url) == "missing"
    again = {r["id"] for r in jobs.requeue("one", lease_timeout_s=60, cancelled=True, url=url)}
    assert again == {"one-0", "one-1", "one-3"}  # one-2 runs under a live lease
    assert jobs.start("one-1", "w2@h", lease_timeout_s=60, max_attempts=3, url=url)["cancel_requested_at"] is None
    jobs.cancel_request("one-1", url=url)
    with store.session_scope(url) as s:  # its worker is lost: the row is not run again
        s.execute(update(Request).where(Request.id == "one-1").values(heartbeat_at=utcnow() - timedelta(hours=1)))
    assert jobs.reclaim(60, url=url) == [] and store.get_request("one-1", url=url)["status"] == "cancelled"


# -- rows a store cannot hold ---------------------------------------------------------------------
def test_a_row_no_store_can_hold_fails_alone_and_the_job_retries(url, pairs_file, tmp_path):
    """A category over 100 characters, or a NUL in any text a row stores (its id, category,
    metadata, parameters, a CSV column), fails that row alone at submit, naming the field, on
    SQLite and PostgreSQL alike; `retry` reads such a job (PostgreSQL's ->> refuses \\u0000)."""
    bad = [
        ({"id": "long", "prompt": "p", "category": "c" * 101}, '"category" is 101 characters'),
        ({"id": "nulcat", "prompt": "p", "category": "a\x00b"}, "category: contains a NUL"),
        ({"id": "a\x00b", "prompt": "p"}, "id: contains a NUL"),
        ({"id": "nulmeta", "prompt": "p", "metadata": {"k": "a\x00b"}}, "metadata.k: contains a NUL"),
        ({"id": "nulparam", "prompt": "p", "params": {"stop": ["\x00"]}}, "params.stop[0]: contains a NUL"),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [{"id": "good", "prompt": "p"}, *(r for r, _ in bad)]))
    sub = client.submit(path, "tiny", {"max_new_tokens": 2})
    assert (sub["rows"], sub["bad"], sub["enqueued"]) == (6, 5, 1)
    good, *refused = client.results(sub["job_id"])
    assert (good["id"], good["status"]) == ("good", "queued")
    for row, (_, fragment) in zip(refused, bad):
        assert row["status"] == "failed" and fragment in row["error"], row
    assert client.retry(sub["job_id"])["bad_input"] == 5
    csv_file = tmp_path / "in.csv"
    csv_file.write_text(f"id,prompt,category,notes\nr1,hi,a,x\nr2,hi,{'c' * 101},x\nr3,hi,b,n\x00te\n")
    rows = {r["id"]: r for r in client.results(client.submit(csv_file, "tiny")["job_id"])}
    assert rows["r1"]["status"] == "queued" and "101 characters" in rows["r2"]["error"]
    assert "notes: contains a NUL" in rows["r3"]["error"]


def test_a_job_name_too_long_to_store_is_refused_or_cut(url, pairs_file, tmp_path):
    path = tmp_path / f"{'f' * 230}.jsonl"
    path.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(RequestError, match="name: 201 characters, over the 200-character limit"):
        client.submit(path, "tiny", name="n" * 201)
    job = client.submit(path, "tiny")["job_id"]
    assert store.get_job(job)["name"] == path.name[:200]
    one_line_exit_2(cli("submit", path, "--pair", "tiny", "--name", "n" * 201), "give a shorter --name")
    if url.startswith("postgresql"):  # what the store refuses anyway is one clear StoreError
        with pytest.raises(store.StoreError, match=r"the database refused a value \(.*too long"):
            store.create_job([{"prompt": "p", "category": "c" * 101}], url=url)


def test_a_name_given_to_a_job_that_exists_is_said_to_be_dropped(url, pairs_file, tmp_path):
    """The same bytes, pair and parameters under another file and --name are the existing job
    (its rows reused): the command says the job keeps its first name, not silently."""
    for day in ("monday", "tuesday"):
        (tmp_path / f"{day}.txt").write_text("a prompt\n")
    first = cli("submit", tmp_path / "monday.txt", "--pair", "tiny", "--name", "nightly-monday")
    again = cli("submit", tmp_path / "tuesday.txt", "--pair", "tiny", "--name", "nightly-tuesday")
    assert first.exit_code == again.exit_code == 0 and first.stdout == again.stdout, again.output
    assert "exists already" not in first.stderr
    assert "the job exists already as 'nightly-monday'" in again.stderr and "not 'nightly-tuesday'" in again.stderr


def test_rows_refused_at_submit_neither_start_the_job_nor_count_in_its_eta(url, pairs_file, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"prompt": "a"}, {"prompt": "b"}, {"prompt": ""})))
    job = client.submit(path, "tiny", {"max_new_tokens": 2})["job_id"]
    st = client.status(job)
    assert (st["status"], st["elapsed_s"], store.get_job(job)["started_at"]) == ("queued", 0.0, None)
    assert admin.list_jobs()[0]["state"] == "queued"
    assert jobs.take(f"{job}-1", "w1@h", lease_timeout_s=60, url=url)
    assert store.get_job(job)["status"] == "running" and store.get_job(job)["started_at"] is not None
    store.record_result(
        f"{job}-1", RESULT, worker=None, device="cpu", queue_wait_s=None, pair="tiny", job_id=job, price_per_hour=None
    )
    st = client.status(job)
    assert st["counts"] == {"queued": 1, "running": 0, "ok": 1, "failed": 1, "cancelled": 0}
    assert st["eta_s"] == pytest.approx(st["elapsed_s"])  # one row ran in that time; one to go (not 2 done)
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text(json.dumps({"prompt": ""}) + "\n")
    bad_job = client.submit(only_bad, "tiny")["job_id"]
    assert (store.get_job(bad_job)["status"], store.get_job(bad_job)["started_at"]) == ("done", None)


def test_results_give_no_acceptance_rate_to_rows_that_never_drafted(url):
    """A row decoded plain (nothing proposed) had `acceptance_rate: 0.0` in `results`, the
    figure of "every draft rejected", while `status` and `report` say none."""
    make_job(url, "plain", ok=2)
    drafted = {**RESULT, "stats": {**RESULT["stats"], "draft_tokens_proposed": 4, "draft_tokens_accepted": 2}}
    drafted["stats"]["acceptance_rate"] = 0.5
    store.create_job(
        [{"id": "plain-2", "prompt": "p2", "params": {"_row": 2, "_id": "2"}}], pair="tiny", job_id="plain", url=url
    )
    store.record_result(
        "plain-2",
        drafted,
        worker=None,
        device="cpu",
        queue_wait_s=None,
        pair="tiny",
        job_id="plain",
        price_per_hour=None,
    )
    rates = [(r["draft_tokens_proposed"], r["acceptance_rate"]) for r in client.results("plain")]
    assert rates == [(0, None), (0, None), (4, 0.5)], rates
