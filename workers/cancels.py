"""``cancel JOB --now``, the worker's side: which of the jobs this process is running asked to stop.

Each task watching a row registers the row's job (``flags.watch(job_id)``) and hands the
returned check to the BatchServer (``submit(..., stop=check)``), which asks it before every
step. The check only reads a set in memory: one thread per process polls the store for every
watched job at once, at most once per ``POLL_S`` (``store.jobs.cancels_requested``), so the
decode loop never waits on the database, and a store that is away only delays a stop.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from specdec_llm.store import jobs

log = logging.getLogger(__name__)

POLL_S = 1.0  # s between looks at the store (for all the jobs this process runs)


class CancelFlags:
    def __init__(self, poll_s: float = POLL_S):
        self.poll_s = poll_s
        self.lock = threading.Lock()
        self.watched: Counter[str] = Counter()  # job id -> rows of it being generated here
        self.flagged: frozenset[str] = frozenset()  # watched jobs whose cancel flag is set
        self.thread: threading.Thread | None = None

    def watch(self, job_id: str) -> Callable[[], bool]:
        """Start watching ``job_id`` for one row; the row's stop check (call ``release`` after)."""
        with self.lock:
            if not self.watched[job_id]:  # what an earlier look said of this job is stale (a retry clears it)
                self.flagged = self.flagged - {job_id}
            self.watched[job_id] += 1
            if self.thread is None or not self.thread.is_alive():  # (a forked child starts its own)
                self.thread = threading.Thread(target=self._poll, name="specdec-cancels", daemon=True)
                self.thread.start()
        return lambda: job_id in self.flagged

    def release(self, job_id: str) -> None:
        with self.lock:
            self.watched[job_id] -= 1
            if self.watched[job_id] <= 0:
                del self.watched[job_id]

    def _poll(self) -> None:
        stop = threading.Event()
        while not stop.wait(self.poll_s):
            with self.lock:
                ids = list(self.watched)
            if not ids:
                self.flagged = frozenset()
                continue
            try:
                self.flagged = frozenset(jobs.cancels_requested(ids))
            except Exception as e:  # noqa: BLE001 - the store is away: rows go on, the next look tries again
                log.debug("could not look for cancelled jobs: %s", e)


flags = CancelFlags()
