"""A streamed row's end marker says how its attempt ended (``workers.tasks._generate_row``), so
the follower tells a cancelled or failed attempt from one that finished, and one its task
retries from both. The task's own path from taking the row (``_take_and_generate``): a real
store (SQLite), the real cancel flags, request building, tokenizer and Celery task; the stream
in the data dir's files (the embedded broker's). Only the decoding server is a stand-in
(``Server``): the point where an outcome is injected. The end-to-end cases, with real workers
and the real server, are in test_worker_batching.py."""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from datetime import timedelta

import pytest
from sqlalchemy import update

from specdec_llm import store
from specdec_llm.client.protocol import FINISHED, MAX_ATTEMPTS, TASK
from specdec_llm.client.streams import follow_stream
from specdec_llm.engine import GenerationRequest, RequestError
from specdec_llm.engine.types import GenerationResult, Stats
from specdec_llm.loaded import Loaded
from specdec_llm.pairs import get_spec, load_pair
from specdec_llm.settings import get_settings, reload_settings
from specdec_llm.store import db, jobs
from specdec_llm.store.models import Request, utcnow
from specdec_llm.store.testing import sqlite_url
from workers import cancels, runtime, tasks
from workers.app import get_app

WORKER = {"host": "gpu-a", "pid": 7, "device_name": "cpu"}
NODE = "w2@gpu-a"  # the worker node that runs the row's second attempt


@pytest.fixture
def streams(pairs_file, tmp_path, monkeypatch):
    """The embedded broker's settings (streams in the data dir's files), the tiny pair, and a
    SQLite store holding row "r1" of job "job", whose first attempt's worker was lost (taken,
    its lease long expired)."""
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND", "SPECDEC_CELERY_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url := sqlite_url(tmp_path))
    reload_settings()
    store.create_job(
        [{"id": "r1", "prompt": "The quick brown fox", "params": {"max_new_tokens": 4, "_stream": True}}],
        pair="tiny",
        job_id="job",
    )
    lease_s = get_settings().lease_timeout_s
    assert jobs.start("r1", "w1@gpu-b", lease_timeout_s=lease_s, max_attempts=MAX_ATTEMPTS)["taken"]
    with store.session_scope() as s:  # its worker gone: no heartbeat since
        s.execute(update(Request).values(heartbeat_at=utcnow() - timedelta(seconds=lease_s + 60)))
    yield tmp_path / "data" / "streams"
    for var in ("SPECDEC_DATA_DIR", "SPECDEC_DATABASE_URL"):  # (pairs_file's setting is its own to undo)
        monkeypatch.delenv(var)
    reload_settings()
    db.dispose_engine(url)


class Server:
    """The one stand-in: the decoding server (``engine.serve.BatchServer``), the fault-injection
    point. It streams "ab" to the row, lets ``meanwhile`` happen (a cancel), then ends as the
    real one does at its next step: cancelled when the row's stop check says so, TimeoutError
    past the row's deadline, else finished as ``outcome`` (a finish reason) or raising it (an
    exception: a bad input the engine refused, a bug, a transient fault, the process exiting)."""

    def __init__(self, tokenizer, outcome, meanwhile=lambda: None):
        self.tokenizer, self.outcome, self.meanwhile = tokenizer, outcome, meanwhile

    def submit(self, request, on_text=None, deadline=None, stop=None) -> Future:
        assert isinstance(request, GenerationRequest)  # what the task built from the stored row
        on_text("ab")
        self.meanwhile()
        future: Future = Future()
        if stop():
            future.set_result(self._result("cancelled"))
        elif deadline is not None and time.monotonic() > deadline:
            future.set_exception(TimeoutError("past its deadline"))
        elif isinstance(self.outcome, BaseException):
            future.set_exception(self.outcome)
        else:
            future.set_result(self._result(self.outcome))
        return future

    def _result(self, finish_reason: str) -> GenerationResult:
        ids = self.tokenizer.encode("ab", add_special_tokens=False)
        return GenerationResult("ab", ids, finish_reason, Stats(output_tokens=len(ids)))


def cancel_now() -> None:
    """``cancel job --now`` as the client does it: the flag in the store, then the broadcast
    that the worker's main process takes (``cancels.on_cancel``, the remote-control command)."""
    written = utcnow()
    jobs.cancel("job", now=True, at=written)
    cancels.on_cancel(None, "job", written.isoformat())


def generate(outcome, *, retries=0, meanwhile=lambda: None, timelimit=None):
    """The task's second attempt at row "r1" (a redelivery to node ``NODE``, its ``retries``-th
    retry): taken from the store, its request built, generated through ``Server``."""
    task = get_app().tasks[TASK]
    spec = get_spec("tiny")
    pair = load_pair(spec)
    loaded = Loaded(spec, pair, None, Server(pair.tokenizer, outcome, meanwhile))
    rt = runtime.Runtime("tiny", "cpu", "float32", loaded, WORKER, None)
    task.push_request(retries=retries, hostname=NODE, timelimit=timelimit)
    try:
        return tasks._take_and_generate(task, "r1", rt, "tiny", time.monotonic())
    finally:
        task.pop_request()


def end_of(streams, attempt: int = 2) -> dict:
    lines = [json.loads(line) for line in (streams / "r1.jsonl").read_text().splitlines() if line.strip()]
    assert lines[0] == {"t": "ab", "a": attempt}
    return lines[-1]


CASES = {  # how the attempt goes -> its end's status, and the row's in the store after it
    "length": (dict(outcome="length"), "ok", "running"),  # (its task writes the result next)
    "stop": (dict(outcome="stop"), "ok", "running"),
    "cancelled": (dict(outcome="length", meanwhile=cancel_now), "cancelled", "cancelled"),
    "bad-input": (dict(outcome=RequestError("prompt", "too long")), "failed", "failed"),
    "timed-out": (dict(outcome="length", timelimit=(None, 1e-9)), "failed", "failed"),
    "an-error": (dict(outcome=RuntimeError("a bug")), "failed", "running"),  # (on_failure fails it)
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_streamed_rows_end_says_how_its_attempt_ended(streams, case):
    """It said only {"end": 1}: a reader could not tell a cancelled attempt that agreed with
    the text given, and stopped part-way, from a sampled one that finished sooner."""
    how, status, row_status = CASES[case]
    try:
        generate(**how)
    except RuntimeError:
        assert isinstance(how["outcome"], RuntimeError)
    assert end_of(streams) == {"end": 1, "a": 2, "s": status}
    assert store.get_request("r1")["status"] == row_status
    follow = follow_stream("r1", lambda: store.get_request("r1")["status"] in FINISHED, timeout_s=10)
    assert next(follow) == "ab"
    with pytest.raises(StopIteration) as stopped:
        next(follow)
    assert stopped.value.value == status


def test_a_transient_fault_says_its_task_retries_the_row_until_out_of_retries(streams):
    with pytest.raises(ConnectionError):
        generate(ConnectionError("the database away a moment"))
    assert end_of(streams) == {"end": 1, "a": 2, "s": "retry"}
    (streams / "r1.jsonl").unlink()
    with pytest.raises(ConnectionError):  # the retry: its node takes the row again, a third attempt
        generate(ConnectionError("still away"), retries=tasks.MAX_RETRIES)
    assert end_of(streams, attempt=3) == {"end": 1, "a": 3, "s": "failed"}


def test_a_process_stopping_says_another_attempt_follows(streams):
    """Not an ``Exception`` (the process exiting): its row is delivered again, so its reader
    waits for the next attempt (an end that said nothing ended the stream there)."""
    with pytest.raises(SystemExit):
        generate(SystemExit(1))
    assert end_of(streams) == {"end": 1, "a": 2, "s": "retry"}
