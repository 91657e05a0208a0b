"""Faults on the whole path, for real: nothing lost, nothing duplicated.

- five SIGKILLs of a worker, each while it generates a row, in a 200-row job (restarted
  after each): the leases requeue the killed rows, no visibility-timeout tuning;
- the broker (a private redis-server, persistent) killed and restarted mid-job;
- a worker that cannot load its pair (missing model; out of memory at load) exits
  non-zero and leaves the rows queued for a good worker;
- `specdec-llm run` interrupted (SIGINT) and run again: it resumes.

(A 10 s database outage is tests/workers/test_workers.py::test_database_outage_tasks_retry_and_finish.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet import Fleet, assert_exactly_once, make_fleet, write_prompts
from helpers import free_port, unavailable, wait_for

from specdec_llm import client
from specdec_llm.settings import reload_settings
from specdec_llm.store.testing import sqlite_url

pytestmark = pytest.mark.slow
FAST_RESTORE = (
    "broker_transport_options = {'visibility_timeout': 3, 'unacked_restore_interval': 1,"
    " 'unacked_restore_throttle': 1}\n"
)


def fast_restore(folder: Path) -> dict:
    """Env for a worker whose broker hands a dead worker's message to another after 3 s."""
    (folder / "fast_restore.py").write_text(FAST_RESTORE)
    return {"SPECDEC_CELERY_CONFIG": "fast_restore", "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}


def loaded(proc) -> bool:
    """The worker's pool child (or its batching process) holds the pair."""
    import re

    return bool(re.search(r"worker \d+: pair tiny on", Path(proc.log_path).read_text(errors="replace")))


# -- five SIGKILLs ----------------------------------------------------------------------------
LEASES = {"SPECDEC_LEASE_HEARTBEAT_S": "0.5", "SPECDEC_LEASE_TIMEOUT_S": "3"}  # lost rows back in ~3 s


def running_on(job: str, proc) -> list[str]:
    """Rows of ``job`` running under the lease of worker ``proc`` (node specdec-tiny-<pid>@host)."""
    from sqlalchemy import select

    from specdec_llm import store
    from specdec_llm.store.models import Request

    with store.session_scope() as s:
        return list(
            s.scalars(
                select(Request.id).where(
                    Request.job_id == job,
                    Request.status == "running",
                    Request.lease_owner.like(f"specdec-tiny-{proc.pid}@%"),
                )
            )
        )


def kill_mid_row(job: str, proc) -> bool:
    """SIGKILL worker ``proc`` (and its pool child) while it holds a running row; True when
    the kill did land mid-row (that row still running under the dead worker's lease)."""
    wait_for(lambda: running_on(job, proc), 120)
    held = running_on(job, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return bool(held) and set(held) <= set(running_on(job, proc))


def test_five_sigkills_during_a_200_row_job(tmp_path, redis_url, pairs_toml, use):
    """Five SIGKILLs, each landing while the worker is generating a row (checked: the row is
    still running under the dead worker's lease; a kill that missed is not counted and
    another follows). No visibility-timeout tuning: the leases bring the rows back."""
    seed = int(os.environ.get("SPECDEC_TEST_SEED", time.time()))
    rng = random.Random(seed)
    fleet = make_fleet(tmp_path, redis_url, 3, sqlite_url(tmp_path), pairs_toml)
    fleet.env.update(LEASES)
    args = ("--no-calibrate",)
    use(fleet)
    try:
        workers = [fleet.start_worker(f"w{i}", args) for i in range(2)]
        wait_for(lambda: all(loaded(w) for w in workers), 120)
        # rows long enough that five kills land before the job ends (with 32 tokens, then with
        # 96 once the lean forward made the tiny pair faster, the workers finished all 200 rows
        # first, and the next kill waited for a running row in vain)
        sub = client.submit(write_prompts(tmp_path / "p.jsonl", 200, "kill5"), "tiny", {"max_new_tokens": 256})
        job = sub["job_id"]
        mid_row = kills = 0
        while mid_row < 5 and kills < 15:
            i = rng.randrange(len(workers))
            mid_row += kill_mid_row(job, workers[i])
            kills += 1
            workers[i] = fleet.start_worker(f"w{i}-{kills}", args)
            time.sleep(rng.uniform(0, 1.5))
        assert mid_row == 5, f"only {mid_row} of {kills} kills landed mid-row"
        # leases bring back the killed rows; `run`'s resend covers a message taken by a worker
        # killed before it marked its row running (the row is still queued, its message gone).
        # A bound on liveness, not speed: on a loaded machine (make test beside another suite)
        # these rows took 2-3 s each, and 180 s after the kills left 5 rows to go
        client.wait(job, workers=workers, timeout_s=600, requeue_lost_after_s=10)
        assert_exactly_once(job, 200)  # one output and one telemetry row each, every row ok
        requeued = sum(r["requeues"] for r in (store_get(rid) for rid in ids(job)))
        assert requeued >= 5  # each killed row went back to the queue by its lease (exactly once each)
        print(f"seed {seed}: {kills} kills, {mid_row} mid-row, {requeued} rows requeued by lease")
    except BaseException:
        print(f"seed {seed} (SPECDEC_TEST_SEED={seed} repeats it)\n{fleet.log()[-4000:]}")
        raise
    finally:
        fleet.stop()


def ids(job: str) -> list[str]:
    return [r["id"] for r in client.job_requests(job, outputs=False)]


def store_get(rid: str) -> dict:
    from specdec_llm import store

    return store.get_request(rid)


# -- the broker restarted ---------------------------------------------------------------------
class Redis:
    """A private, persistent redis-server (append-only file, fsync always) that the test can
    kill and start again on the same port, with the same data."""

    def __init__(self, folder: Path, persistent: bool = True):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            unavailable("redis-server is not installed")
        self.folder, self.port, self.proc, self.persistent = folder, free_port(), None, persistent
        self.url = f"redis://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *aof, "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        self.proc.kill()  # no shutdown save: what is on disk is what fsync put there
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def test_rows_whose_messages_were_lost_are_sent_again_with_nobody_waiting(tmp_path, redis_url, pairs_toml, use):
    """A job fed by `submit` alone (no `run` or `wait` resending): its messages are lost
    before any worker takes them (the queue purged, as a broker restarted without persistence
    loses it; a worker SIGKILLed between taking a message and its row loses one). An idle
    worker's lease step sends those rows again once they are a lease timeout old: every row
    finishes, once."""
    from specdec_llm.client.broker import get_app
    from specdec_llm.client.protocol import queue_name

    fleet = make_fleet(tmp_path, redis_url, 8, sqlite_url(tmp_path), pairs_toml)
    fleet.env.update(LEASES)
    use(fleet)
    try:
        job = client.submit(write_prompts(tmp_path / "p.jsonl", 6, "lost"), "tiny", {"max_new_tokens": 8})["job_id"]
        with get_app().connection_for_write() as conn:
            assert conn.default_channel.queue_purge(queue_name("tiny")) == 6
        worker = fleet.start_worker("w", ("--no-calibrate",))
        wait_for(lambda: client.job_counts(job)["ok"] == 6, 120)  # (leases of 3 s: sent again within a few)
        assert_exactly_once(job, 6)
        assert "were queued with no message waiting: sent again" in fleet.log()
        assert worker.poll() is None
    except BaseException:
        print(fleet.log()[-4000:])
        raise
    finally:
        fleet.stop()


@pytest.mark.parametrize("persistent", [True, False], ids=["aof", "no-persistence"])
def test_broker_restarted_mid_job(tmp_path, pairs_toml, use, persistent):
    """Redis killed and restarted mid-job. The row being generated when it died comes back
    by its lease; without persistence the queued rows' messages are gone too, and `run`'s
    wait (``requeue_lost_after_s``) sends them again. No visibility-timeout tuning."""
    redis = Redis(tmp_path, persistent)
    fleet = make_fleet(tmp_path, redis.url, 0, sqlite_url(tmp_path), pairs_toml)
    fleet.env.update(LEASES)
    use(fleet)
    try:
        worker = fleet.start_worker("w", ("--no-calibrate",))
        wait_for(lambda: loaded(worker), 120)
        sub = client.submit(write_prompts(tmp_path / "p.jsonl", 60, "redis"), "tiny", {"max_new_tokens": 24})
        wait_for(lambda: client.job_counts(sub["job_id"])["ok"] >= 5, 60)
        redis.kill()
        assert client.job_counts(sub["job_id"])["ok"] < 60  # mid-job
        time.sleep(2)  # the worker and this client see connection errors meanwhile
        redis.start()
        client.wait(sub["job_id"], workers=[worker], timeout_s=180, requeue_lost_after_s=5)  # as `run` does
        assert_exactly_once(sub["job_id"], 60)
        assert worker.poll() is None  # the same worker reconnected
        # the client reconnects too: a new job through the same app and producer pool
        again = client.submit(write_prompts(tmp_path / "q.jsonl", 5, "after"), "tiny", {"max_new_tokens": 4})
        client.wait(again["job_id"], workers=[worker], timeout_s=60)
        assert_exactly_once(again["job_id"], 5)
        assert "Connection to broker lost" in fleet.log() or "Cannot connect to redis" in fleet.log()
    except BaseException:
        print(fleet.log()[-4000:])
        raise
    finally:
        fleet.stop()
        redis.stop()


# -- a pair that cannot be loaded ---------------------------------------------------------------
OOM_AT_LOAD = (
    FAST_RESTORE
    + """
import torch as _torch
import specdec_llm.pairs as _pairs

def _out_of_memory(*args, **kwargs):
    raise _torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated by the test)")

_pairs.load_pair = _out_of_memory
"""
)


def test_a_worker_that_cannot_load_exits_nonzero_and_rows_wait(tmp_path, redis_url, pairs_toml, use):
    fleet = make_fleet(tmp_path, redis_url, 4, sqlite_url(tmp_path), pairs_toml)
    use(fleet)
    broken = tmp_path / "broken.toml"  # the same pair name, a model that is not there
    broken.write_text(f'[pairs.tiny]\ntarget = "{tmp_path / "no-such-model"}"\n')
    (tmp_path / "oom_at_load.py").write_text(OOM_AT_LOAD)  # imported with the Celery config: patches the loader
    oom = {"SPECDEC_CELERY_CONFIG": "oom_at_load", "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    fast = fast_restore(tmp_path)  # a message a failed worker had reserved comes back in seconds
    try:
        sub = client.submit(write_prompts(tmp_path / "p.jsonl", 6, "load"), "tiny", {"max_new_tokens": 4})
        for name, args, env, fragment in (
            ("missing-prefork", (), {"SPECDEC_CONFIG_FILE": str(broken), **fast}, "could not load pair tiny"),
            ("oom-prefork", (), oom, "out of memory while loading"),
            ("oom-batching", ("--max-batch", "2"), oom, "out of memory while loading"),
        ):
            proc = fleet.start_worker(name, args, **env)
            assert proc.wait(120) == 3, (name, proc.log_path.read_text()[-3000:])
            log = proc.log_path.read_text()
            assert fragment in log and "CRITICAL" in log and "error: worker stopped: could not load pair tiny" in log
            assert client.job_counts(sub["job_id"])["queued"] == 6, name  # nothing taken, nothing failed
        good = fleet.start_worker("good", ("--no-calibrate",), **fast)
        client.wait(sub["job_id"], workers=[good], timeout_s=120)
        assert_exactly_once(sub["job_id"], 6)
    finally:
        fleet.stop()


# -- the client interrupted ---------------------------------------------------------------------
def test_run_interrupted_then_run_again_resumes(tmp_path, pairs_toml, monkeypatch):
    """`specdec-llm run` (embedded broker, its own local worker) gets SIGINT mid-job: it says
    how to resume, stops its worker and exits 130; the same command again finishes the job
    with every row exactly once."""
    ROWS = 600  # ~20 rows/s on a quiet 2-core machine: the SIGINT after 20 must land mid-job
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_CONFIG_FILE=str(pairs_toml),
        SPECDEC_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    path = write_prompts(tmp_path / "p.jsonl", ROWS, "sigint")
    cmd = [
        sys.executable,
        "-m",
        "specdec_llm",
        "run",
        str(path),
        "--pair",
        "tiny",
        "--max-new-tokens",
        "16",
        "--out",
        str(tmp_path / "out.jsonl"),
    ]
    from specdec_llm.client.rows import job_id_for

    job = job_id_for(path, "tiny", {"max_new_tokens": 16})
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND", "SPECDEC_DATABASE_URL", "SPECDEC_CELERY_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        if k.startswith("SPECDEC_"):
            monkeypatch.setenv(k, v)
    reload_settings()
    try:
        # a child inherits an ignored SIGINT (something earlier in the suite ignores it in this
        # process: the run then finished all rows); a terminal's Ctrl-C meets the default
        inherited = signal.getsignal(signal.SIGINT)
        first = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        db = tmp_path / "data" / "specdec.db"
        wait_for(lambda: _ok_in(db, job) >= 20, 120)
        first.send_signal(signal.SIGINT)  # Ctrl-C in a terminal (the worker is in its own session)
        _, err = first.communicate(timeout=60)
        assert first.returncode == 130, (inherited, err[-3000:])
        assert f"interrupted; run the same command again to resume job {job}" in err
        done_before = _ok_in(db, job)
        assert 20 <= done_before < ROWS
        logs = list((tmp_path / "data" / "logs").glob("worker-tiny-*.log"))
        assert len(logs) == 1 and "Warm shutdown" in logs[0].read_text()  # its worker was stopped
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert second.returncode == 0, second.stderr[-3000:]
        assert f"{ROWS - done_before} to generate" in second.stderr or "to generate" in second.stderr
        assert f"{ROWS} ok, 0 failed" in second.stdout
        assert_exactly_once(job, ROWS)
        items = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert [i["id"] for i in items] == [f"sigint-{i}" for i in range(ROWS)]
    finally:
        monkeypatch.undo()
        reload_settings()


def _ok_in(db: Path, job: str) -> int:
    """Rows of ``job`` done ok, read straight from the run's SQLite file (read-only, its own
    connection: nothing of this test process's store state is involved)."""
    import sqlite3
    from contextlib import closing

    try:
        with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)) as con:
            sql = "SELECT count(*) FROM requests WHERE job_id = ? AND status = 'ok'"
            return con.execute(sql, (job,)).fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def _ok(job: str) -> int:
    try:
        return client.job_counts(job)["ok"]
    except Exception:  # noqa: BLE001 - the job (or the database) is not there yet
        return 0


# -- the embedded broker: `run`'s local worker SIGKILLed ---------------------------------------
def test_run_embedded_survives_its_worker_sigkilled(tmp_path, pairs_toml, monkeypatch):
    """`specdec-llm run` with the embedded broker: its local worker is SIGKILLed while it
    generates a row (whose message file is already gone). `run` starts another worker, the
    row comes back by its lease, and the job ends with every row exactly once."""
    import sqlite3
    from contextlib import closing

    ROWS = 20
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECDEC_")}
    env.update(
        SPECDEC_DATA_DIR=str(tmp_path / "data"),
        SPECDEC_CONFIG_FILE=str(pairs_toml),
        SPECDEC_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        **LEASES,
    )
    path = write_prompts(tmp_path / "p.jsonl", ROWS, "emb")
    cmd = [
        sys.executable,
        "-m",
        "specdec_llm",
        "run",
        str(path),
        "--pair",
        "tiny",
        "--max-new-tokens",
        "32",
        "--out",
        str(tmp_path / "out.jsonl"),
    ]
    db = tmp_path / "data" / "specdec.db"

    def running() -> list[tuple[str, str]]:
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2)) as con:
                sql = "SELECT id, lease_owner FROM requests WHERE status = 'running' AND lease_owner IS NOT NULL"
                return con.execute(sql).fetchall()
        except sqlite3.Error:
            return []

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(running, 120)
        killed = running()  # (the default worker batches: several rows may be running)
        row, owner = killed[0]
        pid = int(owner.split("@")[0].rsplit("-", 1)[1])  # node specdec-tiny-<pid>@host
        os.killpg(pid, signal.SIGKILL)  # the worker (and a pool child, if any), mid-row
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert f"{ROWS} ok, 0 failed" in out and "starting another" in err
    for k, v in env.items():
        if k.startswith("SPECDEC_"):
            monkeypatch.setenv(k, v)
    reload_settings()
    try:
        assert_exactly_once(row.rsplit("-", 1)[0], ROWS)  # request ids are <job>-<n>
        requeues = [store_get(r)["requeues"] for r, _ in killed]
        assert max(requeues) == 1  # the killed rows came back once, by their lease (one may have just finished)
    finally:
        monkeypatch.undo()
        reload_settings()


# -- a row longer than the lease timeout keeps its lease -------------------------------------------
SLOW_ROWS = """
import time as _time
import workers.tasks as _tasks

_build = _tasks.build_request

def _slow_build(row, tokenizer):  # runs after the row was taken: it stays running 4 s
    _time.sleep(4)
    return _build(row, tokenizer)

_tasks.build_request = _slow_build
"""


@pytest.mark.parametrize("broker", ["redis", "embedded", "redis-batching"])
def test_a_row_longer_than_the_lease_timeout_is_not_requeued(tmp_path, redis_url, pairs_toml, use, broker):
    """Rows that run 4 s under a 1.5 s lease timeout: the worker's heartbeats keep them (none
    requeued, each generated once), on both brokers and in the batching (threads) pool."""
    (tmp_path / "slow_rows.py").write_text(SLOW_ROWS)
    env = {
        "SPECDEC_DATABASE_URL": sqlite_url(tmp_path),
        "SPECDEC_DATA_DIR": str(tmp_path / "data"),
        "SPECDEC_CONFIG_FILE": str(pairs_toml),
        "SPECDEC_THREADS": "1",
        "SPECDEC_LEASE_HEARTBEAT_S": "0.3",
        "SPECDEC_LEASE_TIMEOUT_S": "1.5",
    }
    if broker != "embedded":
        env["SPECDEC_BROKER_URL"] = f"{redis_url}/5"
    fleet = Fleet(tmp_path, env)
    use(fleet)
    args = ("--no-calibrate", *(("--max-batch", "2") if broker == "redis-batching" else ()))
    try:
        worker = fleet.start_worker(
            "slow", args, SPECDEC_CELERY_CONFIG="slow_rows", PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path])
        )
        sub = client.submit(write_prompts(tmp_path / "p.jsonl", 2, f"slow-{broker}"), "tiny", {"max_new_tokens": 4})
        client.wait(sub["job_id"], workers=[worker], timeout_s=120)
        assert_exactly_once(sub["job_id"], 2)
        rows = [store_get(rid) for rid in ids(sub["job_id"])]
        assert [(r["requeues"], r["attempts"]) for r in rows] == [(0, 1), (0, 1)], fleet.log()[-3000:]
    finally:
        fleet.stop()
