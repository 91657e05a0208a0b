"""Accepted text from a worker to the client waiting on it (LangChain ``.stream``).

A request stored with ``"_stream": true`` in its params has its text published while it is
generated, delta by delta as the engine accepts tokens (``StreamWriter`` is the engine's
``on_text``, in the worker), then an end marker. Where: a Redis stream
``specdec:stream:<request id>`` (XADD; kept STREAM_TTL_S, so a reader that starts late
misses nothing) when the broker or the result backend is Redis; else, with the embedded
broker (one machine), JSON lines appended to ``<data_dir>/streams/<request id>.jsonl``.
``follow_stream`` (the client) reads either and deletes what it read. Each entry carries its
row's attempt: a row requeued to another worker (its first one lost) publishes its text from
the start again, and the reader yields only what goes past what it has already given (a greedy
row's text is the same each time; a sampled row's that is not ends the stream with
``StreamDiverged``). The end marker says how its attempt ended (``"s"``: ``ok``, ``cancelled``,
``failed``; ``retry``: a fault its task retries, so another attempt follows): a cancelled or
failed attempt ends the stream however far it got, provided its text agrees with what was
given, and the follower returns that outcome (the generator's return value; the row's result
says the rest); a finished one that ended short of what was given raises ``StreamDiverged``.
A marker without ``"s"`` (an older worker) ends the stream as before: after no text, just
ends it; after some, short of what was given, ``StreamDiverged``. Streaming is best
effort: a failing write stops the stream, never the generation (the client still gets the
whole result from the task). Both ends import this module; it imports neither.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from specdec_llm.errors import SpecDecError
from specdec_llm.settings import get_settings

log = logging.getLogger(__name__)

STREAM_TTL_S = 3600
_redis_clients: dict[tuple[int, str], object] = {}


def stream_key(request_id: str) -> str:
    return f"specdec:stream:{request_id}"


def _stream_redis_url() -> str | None:
    settings = get_settings()
    for url in (settings.broker_url, settings.result_backend):
        if url and url.startswith(("redis://", "rediss://", "unix://")):
            return url
    return None


def _redis(url: str) -> Any:  # (a redis.Redis)
    key = (os.getpid(), url)  # a forked worker child opens its own connections
    if key not in _redis_clients:
        import redis

        _redis_clients[key] = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)
    return _redis_clients[key]


def _stream_file(request_id: str) -> Path:
    return get_settings().data_dir / "streams" / f"{request_id}.jsonl"


class StreamWriter:
    """The worker's end. ``writer(text)`` publishes one delta; ``close()`` the end marker.
    ``attempt``: the row's attempt (the store's count), so a reader tells a requeued row's
    second start from more text."""

    def __init__(self, request_id: str, attempt: int = 1):
        self.request_id, self.url, self.broken = request_id, _stream_redis_url(), False
        self.attempt, self.started = attempt, False

    def _put(self, entry: dict[str, Any]) -> None:
        if self.broken:
            return
        data = json.dumps(entry, ensure_ascii=False)
        try:
            if self.url:  # (the stream made by the first write only: a reader gone deleted it)
                key = stream_key(self.request_id)
                pipe = _redis(self.url).pipeline(transaction=False)
                pipe.xadd(key, {"e": data}, nomkstream=self.started)
                pipe.expire(key, STREAM_TTL_S)
                added, _ = pipe.execute()
                self.started = True
                if added is None:
                    raise FileNotFoundError(key)
            else:
                self._append(data)
        except FileNotFoundError:  # the reader read its end and deleted the stream: no one reads on
            self.broken = True
        except Exception as e:  # noqa: BLE001 - never fail a generation over its stream
            self.broken = True
            log.warning("request %s: streaming stopped: %s", self.request_id, e)

    def _append(self, data: str) -> None:
        """One line, after a line break (a line a killed worker left cut short stays a line of
        its own); the file is created by the first write only, so a reader gone (it deletes the
        file) leaves none behind."""
        path = _stream_file(self.request_id)
        if not self.started:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | (0 if self.started else os.O_CREAT), 0o600)
        self.started = True
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("\n" + data + "\n")

    def __call__(self, text: str) -> None:
        self._put({"t": text, "a": self.attempt})

    def close(self, status: str | None = None) -> None:
        """The end marker; ``status``: how the attempt ended, which its reader acts on: "ok"
        (its text is whole), "cancelled" or "failed" (it stopped; the row's result says why),
        "retry" (a fault its task retries: another attempt follows); None: unsaid, read as an
        older worker's marker."""
        self._put({"end": 1, "a": self.attempt} | ({"s": status} if status else {}))


def _entry(line: bytes) -> dict[str, Any] | None:
    """A stream file's line, or None for one a killed worker left cut short."""
    try:
        entry = json.loads(line)
    except ValueError:
        log.debug("a stream line cut short, skipped: %r", line[:80])
        return None
    return entry if isinstance(entry, dict) else None


class StreamDiverged(SpecDecError, RuntimeError):
    """A requeued row's new attempt wrote text other than what its stream already gave."""


class _Attempts:
    """What a reader has given of a row's text, across its attempts: a later attempt starts
    over, and only its text past what was given is new; an earlier one's entries are stale.
    A later attempt whose text differs from what was given (a sampled row) ends the stream
    with ``StreamDiverged``: the text streamed so far is not the row's, and no splice of two
    attempts is passed off as one; so does one that finished ("ok") short of what was given.
    One that was cancelled or failed wrote nothing that differs, however far it got: it ends
    the stream with that ``outcome``, and the caller reads the rest from the row's result."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.attempt, self.read = 0, 0  # attempt followed; characters of it read
        self.given = ""  # what was yielded
        self.outcome: str | None = None  # how the attempt followed ended, as its end marker says

    def current(self, entry: dict[str, Any]) -> bool:
        """Whether ``entry`` is of the attempt followed (a later one starts being followed)."""
        attempt = int(entry.get("a", 0))
        if attempt > self.attempt:
            self.attempt, self.read = attempt, 0
        return attempt == self.attempt

    def ended(self, entry: dict[str, Any]) -> bool:
        """Whether ``entry`` ends the stream: the end of the attempt followed, unless its task
        retries it (another attempt follows). ``StreamDiverged`` if that attempt finished short
        of the text already given (a requeued sampled row that ended sooner); one cancelled or
        failed ends it wherever it stopped (its text agreed so far: ``new_text`` checked it). A
        marker that does not say how (an older worker's): one that ended at character 0 gave
        no text to differ, one that ended after some short of what was given diverged."""
        if "end" not in entry or not self.current(entry):
            return False
        status = entry.get("s")
        if status == "retry":
            return False
        short = self.read < len(self.given) and (status == "ok" or (status is None and self.read > 0))
        if short:
            raise StreamDiverged(
                f"request {self.request_id}: its worker was lost and the row started over, ending at "
                f"character {self.read} (attempt {self.attempt}) where the stream had given "
                f"{len(self.given)}; the text streamed so far is not the row's: read its result, or ask again"
            )
        self.outcome = str(status) if status else None
        return True

    def new_text(self, entry: dict[str, Any]) -> str:
        if "end" in entry or not self.current(entry):
            return ""
        text, start = str(entry["t"]), self.read
        self.read += len(text)
        seen = self.given[start : self.read]  # (a requeued row catching up with what was given)
        if not text.startswith(seen):
            parted = start + next(i for i, (a, b) in enumerate(zip(seen, text)) if a != b)
            raise StreamDiverged(
                f"request {self.request_id}: its worker was lost and the row started over with other "
                f"text (attempt {self.attempt}, at character {parted}); the text "
                "streamed so far is not the row's: read its result, or ask again"
            )
        text = text[len(seen) :]
        self.given += text
        return text


def follow_stream(
    request_id: str, done: Callable[[], bool], *, timeout_s: float | None = None, poll_s: float = 0.1
) -> Generator[str, None, str | None]:
    """The client's end: yield each text delta as the worker publishes it, until the end
    marker, or until ``done()`` (the task is over; e.g. a worker that died publishes no end)
    and nothing more is there. Returns how the row's attempt ended, as its end marker says
    (``"ok"``, ``"cancelled"``, ``"failed"``; None where no marker said: ``outcome =
    yield from follow_stream(...)``). Raises TimeoutError after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    url = _stream_redis_url()
    key, path = stream_key(request_id), _stream_file(request_id)
    last_id, offset, partial = "0-0", 0, b""
    finished = False
    reading = _Attempts(request_id)
    try:
        while True:
            entries = []
            if url:
                block = poll_s if deadline is None else max(0.001, min(poll_s, deadline - time.monotonic()))
                for _, items in _redis(url).xread({key: last_id}, count=256, block=int(block * 1000)) or []:
                    for entry_id, fields in items:
                        last_id = entry_id
                        entries.append(json.loads(fields[b"e"]))
            else:
                try:
                    with open(path, "rb") as f:
                        f.seek(offset)
                        data = f.read()
                except FileNotFoundError:
                    data = b""
                offset += len(data)
                *lines, partial = (partial + data).split(b"\n")
                entries = [e for line in lines if line.strip() and (e := _entry(line)) is not None]
                if not entries:
                    time.sleep(poll_s)
            for entry in entries:
                if reading.ended(entry):
                    return reading.outcome
                if text := reading.new_text(entry):
                    yield text
            if entries:
                continue
            if finished:
                return None
            finished = bool(done())  # read once more after this: what came before the end
            if not finished and deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"request {request_id}: no end of its stream after {timeout_s} s")
    finally:
        try:
            if url:
                _redis(url).delete(key)
            else:
                path.unlink(missing_ok=True)
        except Exception:  # noqa: BLE001 - cleanup only (the key expires anyway)
            pass
