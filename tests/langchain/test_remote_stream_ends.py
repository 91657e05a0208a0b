"""Remote ``stream`` (``RemoteBackend.stream``) on a row retried after its first worker was
lost, as the follower reads its second attempt's end. Everything real (a SQLite store, a
Redis broker, result backend and stream) but the worker: the test plays the row's two
workers (``play_workers``): it takes the task's message off the pair's queue, publishes the
two attempts' text to the row's stream and stores the task's result in the result backend,
so that each attempt streams exactly what the case needs (a real worker's text is its
model's). The end-to-end cases, with a real worker, are in test_langchain.py."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from specdec_llm.client import StreamDiverged
from specdec_llm.client.broker import get_app
from specdec_llm.client.protocol import TASK, queue_name
from specdec_llm.client.streams import StreamWriter
from specdec_llm.langchain.backend import Call, GenerationFailed, Item
from specdec_llm.langchain.remote import RemoteBackend
from specdec_llm.settings import reload_settings
from specdec_llm.store import db
from specdec_llm.store.testing import sqlite_url


@pytest.fixture(autouse=True)
def remote(pairs_file, redis_url, tmp_path, monkeypatch):
    """Remote mode: a Redis broker (its result backend too) on a database of the module's
    private redis-server, emptied after; a SQLite store; the tiny pair."""
    broker = f"{redis_url}/3"
    for var in ("SPECDEC_RESULT_BACKEND", "SPECDEC_CELERY_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_BROKER_URL", broker)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("SPECDEC_DATABASE_URL", url := sqlite_url(tmp_path))
    reload_settings()
    yield
    redis.Redis.from_url(broker).flushdb()  # the message, the stream, the result, the cancel's broadcast
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_DATA_DIR", "SPECDEC_DATABASE_URL"):
        monkeypatch.delenv(var)  # (pairs_file's setting is its own to undo)
    reload_settings()
    db.dispose_engine(url)


def play_workers(second: list[str], status: str, out: dict, played: dict) -> threading.Thread:
    """The row's workers, on a thread: take the call's message from the queue; the first
    attempt streams "abc", "def" (its worker lost); the second streams ``second`` and ends
    ``status``; then the task's result ``out`` (its ``request_id``: the row's) is stored.
    ``played``: the row's id ("rid"), or the thread's error ("error")."""

    def work() -> None:
        try:
            play()
        except BaseException as e:  # noqa: BLE001 - said by ``stream``, in the test's thread
            played["error"] = e

    def play() -> None:
        app = get_app()
        with app.connection_for_read() as conn:
            queue = conn.SimpleQueue(app.amqp.queues[queue_name("tiny")], no_ack=True)
            message = queue.get(timeout=30)
            queue.close()
        (rid, pair), task_id = message.payload[0], message.headers["id"]
        assert (message.headers["task"], pair) == (TASK, "tiny")
        played["rid"] = rid
        first, retried = StreamWriter(rid, 1), StreamWriter(rid, 2)
        first("abc")
        first("def")
        for text in second:
            retried(text)
        retried.close(status)
        app.backend.store_result(task_id, {**out, "request_id": rid}, "SUCCESS")

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def stream(second: list[str], status: str, out: dict, played: dict | None = None) -> list:
    """What ``stream`` gave of the call's row: its first attempt streamed "abc", "def", its
    second ``second`` and ended ``status``; the task returned ``out``."""
    played = {} if played is None else played
    worker = play_workers(second, status, out, played)
    call = Call("tiny", "remote", {}, "lc", None, None, 20.0, False, 0, time.monotonic())
    got: list = []
    try:
        for chunk in RemoteBackend().stream(Item(prompt="hi"), call):
            got.append(chunk)
    finally:
        worker.join(30)
        if "error" in played:
            raise played["error"]
    return got


def finished(text: str) -> dict:
    return {"status": "ok", "text": text, "token_ids": [1], "finish_reason": "stop", "stats": {}}


def test_a_retried_row_cancelled_part_way_fails_as_cancelled_not_diverged():
    """Its second attempt agreed with "abcdef" and was cancelled at "ab": the call learns the
    row was cancelled (GenerationFailed), not that its text diverged (StreamDiverged, before)."""
    out = {"status": "cancelled", "text": "ab", "finish_reason": "cancelled"}
    played: dict = {}
    with pytest.raises(GenerationFailed, match="failed: cancelled") as failed:
        stream(["ab"], "cancelled", out, played)
    assert str(failed.value).startswith(f"request {played['rid']} failed: cancelled")


def test_a_retried_row_that_finished_with_no_text_is_diverged_not_a_result():
    """A sampled row's second attempt finished with "": the stream had given "abcdef", so its
    result's text is not what was streamed. It yielded that result ("" after "abcdef")."""
    with pytest.raises(StreamDiverged, match="ending at character 0"):
        stream([], "ok", finished(""))


def test_a_retried_row_that_finished_as_given_returns_its_result():
    played: dict = {}
    got = stream(["abcdefg"], "ok", finished("abcdefg"), played)
    assert [c for kind, c in got if kind == "text"] == ["abc", "def", "g"]
    assert got[-1][0] == "result" and got[-1][1]["text"] == "abcdefg"
    assert got[-1][1]["request_id"] == played["rid"]
