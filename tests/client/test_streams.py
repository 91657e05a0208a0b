"""A row's streamed text, worker to client (``client/streams.py``), on Redis and in files."""

from __future__ import annotations

import pytest

from specdec_llm.client.streams import StreamWriter, follow_stream
from specdec_llm.settings import reload_settings


@pytest.fixture(params=["redis", "files"])
def streams(request, tmp_path, monkeypatch):
    """Streams on a private Redis (a Redis broker) or in the data dir's files (the embedded one)."""
    for var in ("SPECDEC_BROKER_URL", "SPECDEC_RESULT_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    if request.param == "redis":
        monkeypatch.setenv("SPECDEC_BROKER_URL", f"{request.getfixturevalue('redis_url')}/5")
    reload_settings()
    yield request.param
    monkeypatch.undo()
    reload_settings()


def test_a_requeued_row_streams_only_the_text_past_what_was_given(streams):
    """Its first worker lost mid-row, the row starts over on another: the reader gives only what
    goes past the text it gave (a greedy row's text is the same each time), and a late entry of
    the lost attempt is stale. It once gave "Hel", "lo w", then "Hello wor", "ld" again."""
    first = StreamWriter("row-1", 1)
    first("Hel")
    first("lo w")
    second = StreamWriter("row-1", 2)
    second("Hello")
    first("XX")  # (the first worker, slow but not dead)
    second(" wor")
    first.close()
    second("ld")
    second.close()
    got = list(follow_stream("row-1", lambda: False, timeout_s=10))
    assert got == ["Hel", "lo w", "or", "ld"] and "".join(got) == "Hello world"


def test_a_requeued_row_with_other_text_ends_its_stream_instead_of_splicing(streams):
    """A sampled row started over writes other text: the reader has given "Hel", "lo w" of the
    first attempt and must not go on with the second's "...ld!" as if one text: it raises,
    naming the row and where the texts part."""
    from specdec_llm.client import StreamDiverged

    first = StreamWriter("row-2", 1)
    first("Hel")
    first("lo w")
    second = StreamWriter("row-2", 2)
    second("Hel")  # (agrees so far)
    second("p, world!")
    second.close()
    got: list[str] = []
    with pytest.raises(StreamDiverged, match=r"^request row-2: .*\(attempt 2, at character 3\)"):
        for text in follow_stream("row-2", lambda: False, timeout_s=10):
            got.append(text)
    assert got == ["Hel", "lo w"]


def test_a_requeued_row_that_ends_sooner_ends_its_stream_with_stream_diverged(streams):
    """A sampled row started over and ended before the text already given ("ab" of "abcdef"):
    the stream said "abcdef", the row's text is "ab"; once the reader returned as if complete."""
    from specdec_llm.client import StreamDiverged

    first = StreamWriter("row-3", 1)
    first("abc")
    first("def")
    second = StreamWriter("row-3", 2)
    second("ab")
    second.close()
    with pytest.raises(StreamDiverged, match=r"^request row-3: .*ending at character 2 \(attempt 2\)"):
        list(follow_stream("row-3", lambda: False, timeout_s=10))


def test_a_requeued_row_that_ends_before_any_text_just_ends_its_stream(streams):
    """The row started over and was cancelled, or failed, before its first token: its attempt
    wrote no text, so none differs from what was given ("abcdef"): the stream ends there and
    the caller reads the row's outcome from its result. It was called a divergence "at
    character 0"."""
    first = StreamWriter("row-5", 1)
    first("abc")
    first("def")
    second = StreamWriter("row-5", 2)
    second.close()
    first("XX")  # (a late entry of the lost attempt: stale)
    assert list(follow_stream("row-5", lambda: False, timeout_s=10)) == ["abc", "def"]


def test_a_line_cut_short_by_a_killed_worker_is_skipped_and_a_gone_reader_leaves_no_file(streams, tmp_path):
    first = StreamWriter("row-4", 1)
    first("Hel")
    if streams == "files":  # the worker killed mid-write: half a line, no line break
        with open(tmp_path / "data" / "streams" / "row-4.jsonl", "a") as f:
            f.write('{"t": "lo wo')
    second = StreamWriter("row-4", 2)
    second("Hello")
    second.close()
    assert "".join(follow_stream("row-4", lambda: False, timeout_s=10)) == "Hello"
    second("late")  # the reader read the end and deleted the stream: nothing is written again
    assert not (tmp_path / "data" / "streams" / "row-4.jsonl").exists()
    if streams == "redis":
        from specdec_llm.client.streams import _redis, _stream_redis_url, stream_key

        assert not _redis(_stream_redis_url()).exists(stream_key("row-4"))


def test_a_requeued_row_cancelled_part_way_ends_its_stream_as_cancelled(streams):
    """The row started over, agreed with the text given ("abcdef") and was cancelled at "ab":
    nothing diverged, the row was cancelled: the stream ends there and says so (its end's
    status, the follower's return value). It raised StreamDiverged "ending at character 2"."""
    first = StreamWriter("row-6", 1)
    first("abc")
    first("def")
    second = StreamWriter("row-6", 2)
    second("ab")
    second.close("cancelled")
    got: list[str] = []
    assert yield_all(follow_stream("row-6", lambda: False, timeout_s=10), got) == "cancelled"
    assert got == ["abc", "def"]


@pytest.mark.parametrize("status", ["cancelled", "failed"])
def test_a_requeued_row_that_stops_before_any_text_ends_its_stream_with_how(streams, status):
    first = StreamWriter(f"row-7{status}", 1)
    first("abc")
    second = StreamWriter(f"row-7{status}", 2)
    second.close(status)
    got: list[str] = []
    assert yield_all(follow_stream(f"row-7{status}", lambda: False, timeout_s=10), got) == status
    assert got == ["abc"]


def test_a_requeued_row_that_finished_with_no_text_diverged(streams):
    """A sampled row started over and finished ("ok") with empty text where the stream had
    given "abc": the row's text is "", not "abc". Its end once read as a cancelled one's."""
    from specdec_llm.client import StreamDiverged

    first = StreamWriter("row-8", 1)
    first("abc")
    second = StreamWriter("row-8", 2)
    second.close("ok")
    with pytest.raises(StreamDiverged, match=r"^request row-8: .*ending at character 0 \(attempt 2\)"):
        list(follow_stream("row-8", lambda: False, timeout_s=10))


def test_a_cancelled_attempt_with_other_text_still_diverged(streams):
    from specdec_llm.client import StreamDiverged

    first = StreamWriter("row-9", 1)
    first("abc")
    second = StreamWriter("row-9", 2)
    second("ax")
    second.close("cancelled")
    with pytest.raises(StreamDiverged, match=r"\(attempt 2, at character 1\)"):
        list(follow_stream("row-9", lambda: False, timeout_s=10))


def test_an_attempt_its_task_retries_does_not_end_the_stream(streams):
    """A transient fault (the database away a moment): the task retries the row, and its next
    attempt streams it from the start; the reader follows on to it, and the row's end is the
    last attempt's ("ok", all of "abcdef")."""
    first = StreamWriter("row-10", 1)
    first("abc")
    first.close("retry")
    second = StreamWriter("row-10", 2)
    second("abcdef")
    second.close("ok")
    got: list[str] = []
    assert yield_all(follow_stream("row-10", lambda: False, timeout_s=10), got) == "ok"
    assert got == ["abc", "def"]


def test_an_end_that_does_not_say_how_returns_no_outcome(streams):
    """An end marker without a status (a worker from before it said one) ends the stream as
    before (after no text, as the cases above without one), and the follower says nothing."""
    writer = StreamWriter("row-11", 1)
    writer("abc")
    writer.close()
    got: list[str] = []
    assert yield_all(follow_stream("row-11", lambda: False, timeout_s=10), got) is None
    assert got == ["abc"]


def yield_all(follow, got: list[str]):
    """Every delta of ``follow`` into ``got``; returns what the follower returned."""
    while True:
        try:
            got.append(next(follow))
        except StopIteration as stop:
            return stop.value
