"""``cancel JOB --now``, the worker's side: which of the jobs this process is running asked to stop.

Each task watching a row registers the row's job (``flags.watch(job_id)``) and hands the
returned check (a ``RowStop``) to the BatchServer (``submit(..., stop=check)``), which asks it
before every step. The check only reads a dict in memory: one thread per process polls the
store for every watched job at once (``store.jobs.cancel_times``), so the decode loop never
waits on the database, and a store that is away only delays a stop. The poll keeps the decode
loop's pace: each check wakes the poller, which looks again as soon as its last look is at
least ``MIN_POLL_S`` old (and at least every ``POLL_S`` while rows are watched). So a row
stops within two iterations of the cancel being written (the one running then, and at most
one more) when an iteration takes longer than ``MIN_POLL_S`` plus a query; a faster model
stops within about ``MIN_POLL_S``.

Each ``RowStop`` also counts the iterations that ended after the cancel was written (the
flag carries its time), what ``end_cancelled`` records in the row's error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from datetime import datetime

from specdec_llm.store import jobs, utcnow

log = logging.getLogger(__name__)

POLL_S = 1.0  # s: the longest gap between looks at the store while rows are watched
MIN_POLL_S = 0.05  # s: the shortest (at most 20 queries a second per process, for all its jobs)
_REMEMBERED = 256  # the last steps a row remembers the start of (to count those after a cancel)


class RowStop:
    """One row's stop check (callable: "should this row stop now?"), asked before each step.
    ``iterations_after``: once it said yes, the iterations of the row that ended after the
    cancel was written (the one running then, if any, and those started since)."""

    def __init__(self, flags: CancelFlags, job_id: str):
        self.flags, self.job_id = flags, job_id
        self.steps: deque[datetime] = deque(maxlen=_REMEMBERED)  # when its last steps started
        self.iterations_after: int | None = None

    def __call__(self) -> bool:
        self.flags.wake.set()  # the poller looks again at the decode loop's pace
        written = self.flags.flagged.get(self.job_id)
        if written is None:
            self.steps.append(utcnow())
            return False
        if self.iterations_after is None:
            started_after = sum(1 for t in self.steps if t >= written)
            running_then = len(self.steps) > started_after  # a step had started before the write
            self.iterations_after = started_after + running_then
        return True


class CancelFlags:
    def __init__(self, poll_s: float = POLL_S, min_poll_s: float = MIN_POLL_S):
        self.poll_s, self.min_poll_s = poll_s, min_poll_s
        self.lock = threading.Lock()
        self.watched: Counter[str] = Counter()  # job id -> rows of it being generated here
        self.flagged: dict[str, datetime] = {}  # watched jobs whose cancel flag is set -> when it was written
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def watch(self, job_id: str) -> RowStop:
        """Start watching ``job_id`` for one row; the row's stop check (call ``release`` after)."""
        with self.lock:
            if not self.watched[job_id]:  # what an earlier look said of this job is stale (a retry clears it)
                self.flagged = {k: v for k, v in self.flagged.items() if k != job_id}
            self.watched[job_id] += 1
            if self.thread is None or not self.thread.is_alive():  # (a forked child starts its own)
                self.thread = threading.Thread(target=self._poll, name="specdec-cancels", daemon=True)
                self.thread.start()
        return RowStop(self, job_id)

    def release(self, job_id: str) -> None:
        with self.lock:
            self.watched[job_id] -= 1
            if self.watched[job_id] <= 0:
                del self.watched[job_id]

    def _poll(self) -> None:
        while True:
            self.wake.wait(self.poll_s)  # a row's step asked, or the longest gap passed
            self.wake.clear()
            with self.lock:
                ids = list(self.watched)
            if not ids:
                self.flagged = {}
            else:
                try:
                    self.flagged = jobs.cancel_times(ids)
                except Exception as e:  # noqa: BLE001 - the store is away: rows go on, the next look tries again
                    log.debug("could not look for cancelled jobs: %s", e)
            time.sleep(self.min_poll_s)


flags = CancelFlags()
