"""``cancel JOB --now``, the worker's side: a signal over the broker, the store as the record.

- The client writes the cancel in the store (``jobs.cancel_requested_at``), then broadcasts
  Celery's remote-control command ``protocol.CANCEL_COMMAND`` to every worker (Redis pub/sub
  fanout; the embedded broker's fanout folder). A worker's main process takes it
  (``on_cancel``, registered with Celery's ``Panel``) and ``announce``s it: a counter in
  shared memory, made before the prefork pool forks, so the pool process that holds the row
  sees it too.
- Each row's stop check (a ``RowStop``, asked by the BatchServer before every step) only
  reads memory: the counter and this process's cancelled jobs. When the counter moved since
  this process last looked, its looker thread reads the cancel flags of the jobs it is
  running, once (``store.jobs.cancel_times``), and their rows stop at their next step. The
  decode loop never waits on the database; a store that is away only delays a stop. No
  cancel, no query: a busy worker no longer polls.
- A worker that missed the signal (restarted, or the broker was away when it was sent) still
  finds the record: the task reads the job's flag with its row when it takes it
  (``jobs.start``: a row of a cancelled job stops at its first step), and the lease
  heartbeat reads the flags of the held rows' jobs in the same transaction that renews
  them (``jobs.renew_leases``) and announces a cancelled one as the broadcast would.

So a row stops within two iterations of the cancel being written (the one running then, at
most one more) when an iteration outlasts the broadcast's delivery plus one store read.

Each ``RowStop`` also counts the iterations that ended after the cancel was written (the
flag carries its time), what ``end_cancelled`` records in the row's error.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import Counter, deque
from datetime import datetime
from typing import Any

from specdec_llm.store import jobs, utcnow

log = logging.getLogger(__name__)

RETRY_S = 1.0  # s before the looker tries the store again after a failed read
_REMEMBERED = 256  # the last steps a row remembers the start of (to count those after a cancel)

# Cancels announced to this worker: bumped by its main process, read by every process of the
# worker (shared memory, inherited by the prefork pool's children). Only its change matters.
_announced = multiprocessing.get_context("fork").RawValue("Q", 0)


def announce() -> None:
    """A job was cancelled (a broadcast, or the lease heartbeat found the flag): every process
    of this worker looks at the store for the jobs it is running, once, at its next step."""
    _announced.value = (_announced.value + 1) % 2**63


class RowStop:
    """One row's stop check (callable: "should this row stop now?"), asked before each step.
    ``iterations_after``: once it said yes, the iterations of the row that ended after the
    cancel was written (the one running then, if any, and those started since)."""

    def __init__(self, flags: CancelFlags, job_id: str):
        self.flags, self.job_id = flags, job_id
        self.steps: deque[datetime] = deque(maxlen=_REMEMBERED)  # when its last steps started
        self.iterations_after: int | None = None

    def __call__(self) -> bool:
        if _announced.value != self.flags.seen:  # a cancel was announced since this process looked
            self.flags.wake.set()
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
    """This process's watched jobs (those it is generating rows of) and which were cancelled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watched: Counter[str] = Counter()  # job id -> rows of it being generated here
        self.flagged: dict[str, datetime] = {}  # watched jobs whose cancel flag is set -> when it was written
        self.seen = _announced.value  # the announcement this process last looked for
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def watch(self, job_id: str, cancelled_at: datetime | None = None) -> RowStop:
        """Start watching ``job_id`` for one row, whose job's cancel flag was ``cancelled_at``
        when the row was taken (None: not set); the row's stop check (call ``release`` after)."""
        with self.lock:
            flagged = {k: v for k, v in self.flagged.items() if k != job_id}  # the store said so just now
            if cancelled_at is not None:
                flagged[job_id] = cancelled_at
            self.flagged = flagged
            self.watched[job_id] += 1
            if self.thread is None or not self.thread.is_alive():  # (a forked child starts its own)
                self.thread = threading.Thread(target=self._look, name="specdec-cancels", daemon=True)
                self.thread.start()
        return RowStop(self, job_id)

    def release(self, job_id: str) -> None:
        with self.lock:
            self.watched[job_id] -= 1
            if self.watched[job_id] <= 0:
                del self.watched[job_id]

    def _look(self) -> None:
        """Read the watched jobs' cancel flags each time a step saw a new announcement."""
        while True:
            self.wake.wait()
            self.wake.clear()
            self.seen = _announced.value  # steps stop waking this thread for it
            with self.lock:
                ids = list(self.watched)
            if not ids:
                continue
            try:
                found = jobs.cancel_times(ids)
            except Exception as e:  # noqa: BLE001 - the store is away: rows go on, a later step asks again
                log.warning("could not read the cancelled jobs (%s: %s); trying again", type(e).__name__, e)
                time.sleep(RETRY_S)
                self.seen = -1  # the next step wakes this thread again
                continue
            with self.lock:
                self.flagged = {**{k: v for k, v in self.flagged.items() if k not in ids}, **found}


flags = CancelFlags()


def on_cancel(state: Any, job_id: str | None = None) -> dict[str, Any]:
    """The control command ``protocol.CANCEL_COMMAND`` (``app.control.broadcast`` from
    ``specdec_llm.client.jobs.cancel``), run in the worker's main process."""
    announce()
    return {"ok": f"cancel of job {job_id} announced"}
