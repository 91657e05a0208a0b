"""A worker's heartbeat in the store (``workers`` table): what ``specdec-llm workers`` lists.

The process that holds the pair (a prefork pool child, or the one threads-pool process)
writes, every ``SPECDEC_LEASE_HEARTBEAT_S``: its host, pid, device, the pair and dtype it
serves, its batch size, the rows it has recorded and their output tokens, and its tokens/s
over the last minute (``meter``, fed by the task). A worker that stops writing is shown
stale after the lease timeout. Started by ``runtime`` for a configured worker only
(``specdec-llm worker``), from a daemon thread: a failed write is logged and tried again.
A clean stop (``stop``, at the process's shutdown) writes the final counts and clears the
heartbeat: ``workers`` shows it stopped at once, with every row it recorded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runtime import Runtime

import logging
import threading
import time
from collections import deque

from specdec_llm.settings import get_settings
from specdec_llm.store import admin

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # tokens/s is over this last stretch of time


class Meter:
    """Rows and output tokens this process recorded; its tokens/s over the last ``WINDOW_S``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows = self.tokens = 0
        self.recent: deque[tuple[float, int]] = deque()
        self.since = time.monotonic()

    def add(self, tokens: int) -> None:
        with self.lock:
            self.rows += 1
            self.tokens += tokens
            self.recent.append((time.monotonic(), tokens))

    def rate(self) -> float | None:
        now = time.monotonic()
        with self.lock:
            while self.recent and self.recent[0][0] < now - WINDOW_S:
                self.recent.popleft()
            span = min(WINDOW_S, now - self.since)
            return sum(n for _, n in self.recent) / span if span > 0 else None


meter = Meter()


def beat(rt: Runtime) -> None:
    """One heartbeat of the runtime ``rt`` (``runtime.Runtime``)."""
    admin.heartbeat_worker(
        rt.worker,
        pair=rt.pair,
        dtype=rt.dtype,
        max_batch=rt.server.max_batch,
        rows_done=meter.rows,
        output_tokens=meter.tokens,
        tokens_per_s=meter.rate(),
    )


_stopping = threading.Event()  # set by ``stop``: no beat after it
_writing = threading.Lock()  # a beat and the stop never overlap (the stop is the last write)
_started = False


def start(rt: Runtime) -> threading.Thread:
    """Beat now, then every ``SPECDEC_LEASE_HEARTBEAT_S``, until ``stop`` or the process ends."""
    global _started
    _started = True

    def loop() -> None:
        interval = get_settings().lease_heartbeat_s
        while not _stopping.is_set():
            try:
                with _writing:
                    if not _stopping.is_set():
                        beat(rt)
            except Exception as e:  # noqa: BLE001 - the store is away: the next beat tries again
                log.warning("worker heartbeat failed (%s: %s); the next one tries again", type(e).__name__, e)
            _stopping.wait(interval)

    thread = threading.Thread(target=loop, name="specdec-heartbeat", daemon=True)
    thread.start()
    return thread


def stop(rt: Runtime) -> None:
    """This process stops cleanly: no more beats; its final counts, marked stopped (when it beat)."""
    _stopping.set()
    if not _started:
        return
    with _writing:
        try:
            admin.worker_stopped(rt.worker, rows_done=meter.rows, output_tokens=meter.tokens)
        except Exception as e:  # noqa: BLE001 - the store is away: `workers` shows it stale later
            log.warning("could not mark this worker stopped (%s: %s)", type(e).__name__, e)
