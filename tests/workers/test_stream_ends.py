"""A streamed row's end marker says how its attempt ended (``workers.tasks._generate_row``), so
the follower tells a cancelled or failed attempt from one that finished, and one its task
retries from both. No worker, no broker: a fake server, the stream in the data dir's files."""

from __future__ import annotations

import json
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from specdec_llm.client.streams import follow_stream
from specdec_llm.engine import RequestError
from specdec_llm.settings import reload_settings
from workers import tasks


@pytest.fixture
def streams(tmp_path, monkeypatch):
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    yield tmp_path / "data" / "streams"
    monkeypatch.undo()
    reload_settings()


class Stop:
    by: tuple[str, ...] = ()
    iterations_after = None


def generate(monkeypatch, outcome, *, retries=0):
    """``_generate_row`` on a streamed row (attempt 2) whose server streams "ab", then returns a
    result that finished as ``outcome`` (a finish reason), or raises it (an exception)."""
    monkeypatch.setattr(tasks, "build_request", lambda row, tokenizer: "req")
    monkeypatch.setattr(tasks.cancels, "flags", SimpleNamespace(watch=lambda *a: Stop(), release=lambda keys: None))
    monkeypatch.setattr(tasks.store, "mark_request", lambda *a, **k: None)
    monkeypatch.setattr(tasks.jobs, "end_cancelled", lambda *a, **k: None)

    def submit(req, on_text, deadline, stop):
        on_text("ab")
        future: Future = Future()
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            result = {"text": "ab", "token_ids": [1, 2], "finish_reason": outcome, "stats": {}}
            future.set_result(SimpleNamespace(incomplete=lambda: None, to_dict=lambda: result))
        return future

    rt = SimpleNamespace(loaded=SimpleNamespace(tokenizer=None), server=SimpleNamespace(submit=submit))
    task = SimpleNamespace(
        request=SimpleNamespace(timelimit=None, retries=retries),
        soft_time_limit=None,
        max_retries=tasks.MAX_RETRIES,
        app=SimpleNamespace(conf=SimpleNamespace(task_soft_time_limit=None)),
    )
    row = {"id": "r1", "job_id": "job", "attempts": 2, "params": {"_stream": True}}
    return tasks._generate_row(task, row, rt, "tiny", 0.0)


def end_of(streams) -> dict:
    lines = [json.loads(line) for line in (streams / "r1.jsonl").read_text().splitlines() if line.strip()]
    assert lines[0] == {"t": "ab", "a": 2}
    return lines[-1]


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        ("length", "ok"),
        ("stop", "ok"),
        ("cancelled", "cancelled"),
        pytest.param(RequestError("prompt", "too long"), "failed", id="bad-input"),
        pytest.param(TimeoutError("past its deadline"), "failed", id="timed-out"),
        pytest.param(RuntimeError("a bug"), "failed", id="an-error"),
    ],
)
def test_a_streamed_rows_end_says_how_its_attempt_ended(streams, monkeypatch, outcome, status):
    """It said only {"end": 1}: a reader could not tell a cancelled attempt that agreed with
    the text given, and stopped part-way, from a sampled one that finished sooner."""
    try:
        generate(monkeypatch, outcome)
    except RuntimeError:
        assert isinstance(outcome, RuntimeError)
    assert end_of(streams) == {"end": 1, "a": 2, "s": status}
    follow = follow_stream("r1", lambda: True, timeout_s=10)
    assert next(follow) == "ab"
    with pytest.raises(StopIteration) as stopped:
        next(follow)
    assert stopped.value.value == status


def test_a_transient_fault_says_its_task_retries_the_row_until_out_of_retries(streams, monkeypatch):
    with pytest.raises(ConnectionError):
        generate(monkeypatch, ConnectionError("the database away a moment"))
    assert end_of(streams) == {"end": 1, "a": 2, "s": "retry"}
    (streams / "r1.jsonl").unlink()
    with pytest.raises(ConnectionError):
        generate(monkeypatch, ConnectionError("still away"), retries=tasks.MAX_RETRIES)
    assert end_of(streams) == {"end": 1, "a": 2, "s": "failed"}


def test_a_process_stopping_leaves_its_end_unsaid(streams, monkeypatch):
    """Not an ``Exception`` (the process exiting): its row may be requeued, so the end does
    not say failed; a reader reads it as an end that does not say how."""
    with pytest.raises(SystemExit):
        generate(monkeypatch, SystemExit(1))
    assert end_of(streams) == {"end": 1, "a": 2}
