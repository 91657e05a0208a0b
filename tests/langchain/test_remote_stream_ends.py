"""Remote ``stream`` (``RemoteBackend.stream``) on a row retried after its first worker was
lost, as the follower reads its second attempt's end: no worker, no broker (a fake task
result), the stream in the data dir's files. The end-to-end cases, with a real worker, are in
test_langchain.py."""

from __future__ import annotations

import time

import pytest

from specdec_llm.client import StreamDiverged
from specdec_llm.client.streams import StreamWriter
from specdec_llm.langchain.backend import Call, GenerationFailed, Item
from specdec_llm.langchain.remote import RemoteBackend
from specdec_llm.settings import reload_settings


@pytest.fixture(autouse=True)
def streams(tmp_path, monkeypatch):
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    reload_settings()
    yield
    monkeypatch.undo()
    reload_settings()


class Result:
    """A task's result, there already."""

    def __init__(self, out):
        self.out = out

    def ready(self):
        return True

    def get(self, **kwargs):
        return self.out

    def failed(self):
        return False

    def forget(self):
        pass


def stream(monkeypatch, second: list[str], status: str, out: dict) -> list:
    """What ``stream`` gave of row "r1": its first attempt streamed "abc", "def", its second
    ``second`` and ended ``status``; the task returned ``out``."""
    first, retried = StreamWriter("r1", 1), StreamWriter("r1", 2)
    first("abc")
    first("def")
    for text in second:
        retried(text)
    retried.close(status)
    monkeypatch.setattr(RemoteBackend, "_submit", lambda self, items, call, stream: [("r1", Result(out))])
    monkeypatch.setattr(RemoteBackend, "_cancel", lambda self, ids, reason: None)
    call = Call("tiny", "remote", {}, "lc", None, None, 10.0, False, 0, time.monotonic())
    got: list = []
    for chunk in RemoteBackend().stream(Item(prompt="hi"), call):
        got.append(chunk)
    return got


def finished(text: str) -> dict:
    return {"request_id": "r1", "status": "ok", "text": text, "token_ids": [1], "finish_reason": "stop", "stats": {}}


def test_a_retried_row_cancelled_part_way_fails_as_cancelled_not_diverged(monkeypatch):
    """Its second attempt agreed with "abcdef" and was cancelled at "ab": the call learns the
    row was cancelled (GenerationFailed), not that its text diverged (StreamDiverged, before)."""
    out = {"request_id": "r1", "status": "cancelled", "text": "ab", "finish_reason": "cancelled"}
    with pytest.raises(GenerationFailed, match="r1 failed: cancelled"):
        stream(monkeypatch, ["ab"], "cancelled", out)


def test_a_retried_row_that_finished_with_no_text_is_diverged_not_a_result(monkeypatch):
    """A sampled row's second attempt finished with "": the stream had given "abcdef", so its
    result's text is not what was streamed. It yielded that result ("" after "abcdef")."""
    with pytest.raises(StreamDiverged, match="ending at character 0"):
        stream(monkeypatch, [], "ok", finished(""))


def test_a_retried_row_that_finished_as_given_returns_its_result(monkeypatch):
    got = stream(monkeypatch, ["abcdefg"], "ok", finished("abcdefg"))
    assert [c for kind, c in got if kind == "text"] == ["abc", "def", "g"]
    assert got[-1][0] == "result" and got[-1][1]["text"] == "abcdefg"
