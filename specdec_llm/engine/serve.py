"""Serving many callers from one batch: requests submitted from any thread join the running
``Batch`` at its next iteration (continuous batching); each caller gets its own Future.

    server = BatchServer(decoder, max_batch=8, max_wait_ms=20)
    result = server.submit(request, on_text=print).result()

One thread owns the models and runs the loop. When the batch is empty and a request
arrives, it waits up to ``max_wait_ms`` for more (so a burst starts as one batch), then
steps; between steps it takes waiting requests up to ``max_batch`` rows. A bad request
fails its own Future with the RequestError at join time; an error inside a step (out of
memory...) fails the rows of that batch and the loop goes on with a fresh one. A
request whose ``deadline`` (time.monotonic()) passes leaves the batch with TimeoutError.
Whatever the reason a row leaves (finished, cancelled, timed out, a failed step), its
drafters hear it (``Batch.keep``, ``Batch.close``) and give its resources back.
``max_batch="auto"`` (a bulk job's worker) takes the batch size with the most expected
tokens per second on this machine, from its measured costs (``SpeculativeDecoder.best_batch``,
cached on disk), before serving; ``ready`` is set once it is chosen. ``"auto:N"``: the same up
to N rows (a job of N rows never fills a wider batch: its sizes are not measured).
``cancel(future)`` withdraws a request: not started yet, it never joins; in the batch, it
leaves before the next step (its Future raises CancelledError); the other rows go on.
``submit(..., stop=callable)``: asked before each step; once it returns True the row ends
there with what it has (finish reason "cancelled", its partial text and stats as a normal
result); the other rows go on. It runs on the server's thread before every step: make it
cheap (a flag another thread sets; a bulk job's worker polls its store for it).
The decoder's measured costs are written to its on-disk cache (costcache.py) when the
server goes idle (at most every ``SAVE_EVERY_S``) and when it closes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from .decoder import Batch, Row, SpeculativeDecoder, TextCallback
from .types import GenerationRequest, GenerationResult, RequestError, auto_cap, parse_max_batch

StopCheck = Callable[[], bool]  # "should this row stop now?" (asked before each step)
# a submitted request: (request, on_text, deadline, stop, its future)
_Item = tuple[GenerationRequest, TextCallback | None, float | None, StopCheck | None, "Future[GenerationResult]"]

log = logging.getLogger(__name__)
SAVE_EVERY_S = 30.0  # an idle server writes its live decoding costs to the cache at most this often


class BatchServer:
    def __init__(self, decoder: SpeculativeDecoder, max_batch: int | str = 8, max_wait_ms: float = 20.0):
        try:
            self.setting = parse_max_batch(max_batch)  # as given, normalized
        except ValueError as e:
            raise ValueError(f"max_batch: {e}") from None
        self.cap = auto_cap(self.setting)  # the decoder chooses the size up to it from measured costs (best_batch)
        self.max_batch = 1 if self.cap is not None else int(self.setting)
        self.decoder, self.max_wait = decoder, max_wait_ms / 1000
        self.ready = threading.Event()  # set once the batch size is chosen and its costs measured
        self.inbox: queue.Queue[_Item | None] = queue.Queue()
        self.closed = threading.Event()
        self.cancelled: set[Future[GenerationResult]] = (
            set()
        )  # futures of rows to drop at the next step (server thread reads)
        self._cancel_lock = threading.Lock()
        self.rows = 0  # rows in the batch at its latest step (for monitoring)
        self._saved = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name="specdec-batch", daemon=True)
        self.thread.start()

    def submit(
        self,
        request: GenerationRequest,
        on_text: TextCallback | None = None,
        deadline: float | None = None,
        stop: StopCheck | None = None,
    ) -> Future[GenerationResult]:
        """Queue ``request``; its Future gets its result. ``deadline`` (time.monotonic()):
        past it the row leaves with TimeoutError. ``stop()`` True: the row ends before the
        next step with its partial result (finish reason "cancelled")."""
        if self.closed.is_set():
            raise RuntimeError("this BatchServer is closed")
        fut: Future[GenerationResult] = Future()
        self.inbox.put((request, on_text, deadline, stop, fut))
        if self.closed.is_set():  # closed meanwhile: the loop may have drained the inbox already
            self._drain()
        return fut

    @property
    def waiting(self) -> int:
        """Requests submitted that have not joined the batch yet."""
        return self.inbox.qsize()

    def cancel(self, fut: Future[GenerationResult]) -> bool:
        """Withdraw the request behind ``fut`` (from ``submit``). False when it has already
        finished; else True: it never starts, or leaves the batch before the next step."""
        if fut.cancel():  # still waiting in the inbox: it will never join
            return True
        if fut.done():
            return False
        with self._cancel_lock:
            self.cancelled.add(fut)
        return True

    def close(self, timeout: float | None = None) -> None:
        self.closed.set()
        self.inbox.put(None)
        self.thread.join(timeout)

    # -- the loop (server thread) ---------------------------------------------------------
    def _loop(self) -> None:
        device = self.decoder.target.device
        if device.type == "cuda":  # the current CUDA device is per thread
            import torch

            torch.cuda.set_device(device)
        try:
            if self.cap is not None:
                self.max_batch = self.decoder.best_batch(self.cap)
            self.decoder.calibrate_batches(self.max_batch)
        except Exception:  # a batch calibrates lazily instead
            log.exception("could not calibrate the batch sizes up to %d", self.max_batch)
        self.ready.set()
        batch = Batch(self.decoder)
        while not self.closed.is_set():
            if not batch.rows:  # idle: block for one request, then gather a burst
                item = self.inbox.get()
                if item is None:
                    break
                self._join(batch, item)
                until = time.monotonic() + self.max_wait
                while len(batch.rows) < self.max_batch and (left := until - time.monotonic()) > 0:
                    try:
                        item = self.inbox.get(timeout=left)
                    except queue.Empty:
                        break
                    if item is None:
                        break
                    self._join(batch, item)
            while len(batch.rows) < self.max_batch:  # continuous batching: join between steps
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._join(batch, item)
            try:
                self._expire(batch)
                self.rows = len(batch.rows)
                if not batch.rows:
                    continue
                done = batch.step()
            except Exception as e:  # fail this batch's rows, keep serving
                log.exception("batch step failed; failing its %d rows", len(batch.rows))
                for row in batch.rows:
                    _fail(row.tag[0], e)
                self._close(batch)
                batch = Batch(self.decoder)
                continue
            self.rows = len(batch.rows)
            for row in done:
                _settle(row)
            if not batch.rows and time.monotonic() - self._saved > SAVE_EVERY_S:
                self._save_costs()  # idle: what the batches learnt about the costs, for the next process
        for row in batch.rows:
            _fail(row.tag[0], RuntimeError("BatchServer closed"))
        self._close(batch)
        self._drain()
        self._save_costs()

    def _drain(self) -> None:
        """Requests still in the inbox of a closed server fail (none waits forever)."""
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[4].set_running_or_notify_cancel():
                item[4].set_exception(RuntimeError("BatchServer closed"))

    def _close(self, batch: Batch) -> None:
        """Every row of ``batch`` leaves (its drafters' resources come back), even after a failed step."""
        try:
            batch.close()
        except Exception:  # a batch that failed may fail again; serving goes on
            log.exception("could not release a batch's rows")

    def _save_costs(self) -> None:
        self._saved = time.monotonic()
        try:
            self.decoder.save_costs()
        except Exception:  # a cache, never a reason to stop serving
            log.exception("could not save the decoding costs")

    def _join(self, batch: Batch, item: _Item) -> None:
        request, on_text, deadline, stop, fut = item
        if not fut.set_running_or_notify_cancel():
            return
        try:
            batch.add(request, on_text, tag=(fut, deadline, stop))
        except RequestError as e:
            fut.set_exception(e)
        except Exception as e:  # a failed prefill fails this request only
            log.exception("could not start a request")
            fut.set_exception(e)

    def _expire(self, batch: Batch) -> None:
        """Rows past their deadline (TimeoutError), cancelled (CancelledError) or told to
        stop (their partial result, finish reason "cancelled") leave the batch."""
        from concurrent.futures import CancelledError

        now = time.monotonic()
        with self._cancel_lock:
            cancelled, self.cancelled = self.cancelled, set()
        gone = []
        for b, row in enumerate(batch.rows):
            fut, deadline, stop = row.tag
            if fut in cancelled:
                fut.set_exception(CancelledError("cancelled"))
                gone.append(b)
            elif deadline is not None and now > deadline:
                fut.set_exception(TimeoutError("generation passed its deadline"))
                gone.append(b)
            elif stop is not None and _asks_to_stop(stop):
                _stopped(row)
                _settle(row)
                gone.append(b)
        if gone:
            batch.keep([b for b in range(len(batch.rows)) if b not in gone])


def _asks_to_stop(stop: StopCheck) -> bool:
    try:
        return bool(stop())
    except Exception:  # a broken check never stops a row (nor the batch)
        log.exception("a row's stop check failed; the row goes on")
        return False


def _stopped(row: Row) -> None:
    """The row ends as it stands: what it emitted so far, finish reason "cancelled"."""
    row.finish_reason = "cancelled"
    row.stream(final=True)
    row.finish()


def _settle(row: Row) -> None:
    """A finished row's future gets its result, or what its caller's on_text raised."""
    if row.text_stream.error is not None:
        _fail(row.tag[0], row.text_stream.error)
    else:
        row.tag[0].set_result(row.result)


def _fail(fut: Future[GenerationResult], e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
