"""``cancel JOB --now``, the worker's side: a signal over the broker, the store as the record.

One row is cancelled the same way (``client.cancel_request``: a LangChain stream its caller
stopped reading, a call that timed out): its request id stands where a job id stands below,
and each row's stop check watches both its job and itself.

- The client writes the cancel in the store (``jobs.cancel``, the flag's time chosen by the
  client), then broadcasts Celery's remote-control command ``protocol.CANCEL_COMMAND`` with
  the job's id and that time to every worker (Redis pub/sub fanout; the embedded broker's
  fanout folder). A worker's main process takes it (``on_cancel``, registered with Celery's
  ``Panel``) and ``announce``s it: the job and its time in a small ring in shared memory, then
  a counter, made before the prefork pool forks, so the pool process that holds the row sees
  it too.
- Each row's stop check (a ``RowStop``, asked by the BatchServer before every step) only
  reads memory: when the counter moved, the announcements since this process last looked.
  A row of an announced job stops at that step: no store read stands between the broadcast
  and the stop. An announcement without a job (the lease heartbeat's), or more than the ring
  holds at once, wakes this process's looker thread instead, which reads the cancel flags of
  the jobs it is running, once (``store.jobs.cancel_times``); their rows stop at their next
  step. The decode loop never waits on the database; a store that is away only delays a stop.
  No cancel, no query: a busy worker does not poll.
- A worker that missed the signal (restarted, or the broker was away when it was sent) still
  finds the record: the task reads the job's flag with its row when it takes it
  (``jobs.start``: a row of a cancelled job stops at its first step), and the lease
  heartbeat reads the flags of the held rows' jobs in the same transaction that renews
  them (``jobs.renew_leases``) and announces a cancelled one as the broadcast would.

So a row stops within two iterations of the cancel being written (the one running then, at
most one more) when an iteration outlasts the broadcast's delivery.

Each ``RowStop`` also counts the iterations that ended after the cancel was written (the
flag carries its time), what ``end_cancelled`` records in the row's error.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections import Counter, deque
from datetime import UTC, datetime
from typing import Any

from specdec_llm.store import jobs, utcnow

log = logging.getLogger(__name__)

RETRY_S = 1.0  # s before the looker tries the store again after a failed read
_REMEMBERED = 256  # the last steps a row remembers the start of (to count those after a cancel)
SLOTS = 16  # announcements the ring holds: more at once between two steps, and the looker reads the store
_ID_BYTES = 64  # a job id longer than this is announced without it (the looker reads the store)

# Cancels announced to this worker, written by its main process, read by every process of the
# worker (shared memory, inherited by the prefork pool's children): announcement n's job id
# and flag time (POSIX seconds) in slot n % SLOTS, then the count of announcements. An empty
# id: "some job was cancelled" (the looker reads which).
_fork = multiprocessing.get_context("fork")
_announced = _fork.RawValue("Q", 0)
_ids = _fork.RawArray("c", SLOTS * _ID_BYTES)
_times = _fork.RawArray("d", SLOTS)
_writing = threading.Lock()  # (the main process announces from the control command and the lease step)


def announce(job_id: str | None = None, written: datetime | None = None) -> None:
    """A job was cancelled (a broadcast, with the job and its flag's time; or the lease
    heartbeat found a flag): every process of this worker learns it at its next step."""
    raw, seconds = b"", 0.0
    if job_id and written is not None and len(job_id.encode()) <= _ID_BYTES:
        raw, seconds = job_id.encode(), written.replace(tzinfo=UTC).timestamp()
    with _writing:
        n = _announced.value
        slot = n % SLOTS
        _ids[slot * _ID_BYTES : (slot + 1) * _ID_BYTES] = raw.ljust(_ID_BYTES, b"\0")
        _times[slot] = seconds
        _announced.value = n + 1  # (last: a reader that sees the count finds the slot written)


def _announcement(n: int) -> tuple[str, datetime] | None:
    """Announcement ``n``'s job and flag time, or None where it named none."""
    slot = n % SLOTS
    raw = _ids[slot * _ID_BYTES : (slot + 1) * _ID_BYTES].rstrip(b"\0")
    if not raw:
        return None
    return raw.decode(errors="replace"), datetime.fromtimestamp(_times[slot], UTC).replace(tzinfo=None)


class RowStop:
    """One row's stop check (callable: "should this row stop now?"), asked before each step:
    its job's cancel or its own (``keys``: the job id and the request id).
    ``iterations_after``: once it said yes, the iterations of the row that ended after the
    cancel was written (the one running then, if any, and those started since)."""

    def __init__(self, flags: CancelFlags, keys: tuple[str, ...]):
        self.flags, self.keys = flags, keys
        self.steps: deque[datetime] = deque(maxlen=_REMEMBERED)  # when its last steps started
        self.iterations_after: int | None = None
        self.by: tuple[str, ...] = ()  # once it said yes: the keys whose cancel stopped it

    def __call__(self) -> bool:
        if _announced.value != self.flags.seen:  # a cancel was announced since this process looked
            self.flags.catch_up()
        flagged = self.flags.flagged
        written = min((flagged[k] for k in self.keys if k in flagged), default=None)
        if written is None:
            self.steps.append(utcnow())
            return False
        if self.iterations_after is None:
            self.by = tuple(k for k in self.keys if k in flagged)
            started_after = sum(1 for t in self.steps if t >= written)
            running_then = len(self.steps) > started_after  # a step had started before the write
            self.iterations_after = started_after + running_then
        return True


class CancelFlags:
    """This process's watched jobs and rows (those it is generating) and which were cancelled:
    a key is a job id (``cancel --now``) or a request id (``cancel_request``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.watched: Counter[str] = Counter()  # job or request id -> rows of it being generated here
        self.flagged: dict[str, datetime] = {}  # watched keys whose cancel flag is set -> when it was written
        self.seen = _announced.value  # the announcements this process has looked at
        # watched job -> the announcements made before it was watched: what the store said when
        # its row was taken is newer than those (a retried job's old cancel must not stop it)
        self.since: dict[str, int] = {}
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None

    def watch(self, keys: tuple[str, ...], cancelled: dict[str | None, datetime | None] | None = None) -> RowStop:
        """Start watching one row: ``keys``, its job id and request id, whose cancel flags were
        ``cancelled`` (key -> when written; None or absent: not set) when the row was taken;
        the row's stop check (call ``release(keys)`` after)."""
        with self.lock:
            flagged = {k: v for k, v in self.flagged.items() if k not in keys}  # the store said so just now
            flagged.update((k, t) for k, t in (cancelled or {}).items() if k in keys and t is not None)
            self.flagged = flagged
            for key in keys:
                self.since.setdefault(key, _announced.value)
                self.watched[key] += 1
            if self.thread is None or not self.thread.is_alive():  # (a forked child starts its own)
                self.thread = threading.Thread(target=self._look, name="specdec-cancels", daemon=True)
                self.thread.start()
        return RowStop(self, keys)

    def release(self, keys: tuple[str, ...]) -> None:
        with self.lock:
            gone = []
            for key in keys:
                self.watched[key] -= 1
                if self.watched[key] <= 0:
                    del self.watched[key], self.since[key]
                    gone.append(key)
            if any(k in self.flagged for k in gone):  # (what the store says when a row of it is taken again)
                self.flagged = {k: v for k, v in self.flagged.items() if k not in gone}

    def catch_up(self) -> None:
        """The announcements since this process last looked: a watched job named there is
        flagged now; one that named no job, more than the ring holds, or a job's announcement
        from before its row was taken (made while the row was being taken, or stale) wake the
        looker, which asks the store."""
        with self.lock:
            now = _announced.value
            unknown = now - self.seen >= SLOTS  # (the oldest may have been written over)
            found = {}
            for n in range(max(self.seen, now - SLOTS + 1), now):
                said = _announcement(n)
                if said is None:
                    unknown = True
                elif said[0] in self.watched:
                    if n >= self.since[said[0]]:
                        found[said[0]] = said[1]
                    else:
                        unknown = True
            self.seen = now
            if found:
                self.flagged = {**self.flagged, **found}
        if unknown:
            self.wake.set()

    def _look(self) -> None:
        """Read the watched jobs' and rows' cancel flags each time an announcement named none."""
        while True:
            self.wake.wait()
            self.wake.clear()
            with self.lock:
                ids = list(self.watched)
            if not ids:
                continue
            try:
                found = jobs.cancel_times(ids)
            except Exception as e:  # noqa: BLE001 - the store is away: rows go on, the looker asks again
                log.warning("could not read the cancelled jobs (%s: %s); trying again", type(e).__name__, e)
                time.sleep(RETRY_S)
                self.wake.set()
                continue
            with self.lock:  # (a flag set meanwhile by a broadcast stays: this read may predate it)
                self.flagged = {**self.flagged, **found}


flags = CancelFlags()


def on_cancel(state: Any, job_id: str | None = None, written: str | None = None) -> dict[str, Any]:
    """The control command ``protocol.CANCEL_COMMAND`` (``app.control.broadcast`` from
    ``specdec_llm.client.jobs.cancel``), run in the worker's main process. ``written``: the
    flag's time (ISO, naive UTC); without it the looker reads the store."""
    try:
        when = datetime.fromisoformat(written) if written else None
    except ValueError:
        when = None
    announce(job_id, when)
    return {"ok": f"cancel of job {job_id} announced"}
