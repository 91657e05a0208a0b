"""The job protocol the client and the workers share: one task, its name, its queues and
its message, in one place both ends import (the client sends by name: ``jobs.enqueue``;
the worker defines the task: ``workers/tasks.py``).

- ``TASK``: the task's name; ``queue_name(pair)``: the one queue per pair a worker of that
  pair consumes.
- ``task_message(request_id, pair, enqueued_at=)``: ``send_task``'s ``args``, ``kwargs``
  and ``queue`` for one stored request row. A message carries ids only: the worker reads
  the row (prompt, parameters) from the store.
- ``MAX_ATTEMPTS``: deliveries of a row that died mid-generation (its worker lost) before
  the row is given up as failed (the task and the lease step both count them).
- ``CANCEL_COMMAND``: the remote-control command (Celery's ``app.control.broadcast``) that
  tells every worker a job was cancelled ``--now`` (argument ``job_id``; the store holds the
  flag, the workers read it when told: ``workers/cancels.py``).
- ``FINISHED``: the row states a delivery of the task leaves alone (a redelivered message is
  a no-op). The task returns a JSON dict ``{"request_id", "status", ...}``: a ``FINISHED``
  status, or "forwarded" (sent on to its pair's queue), "missing" (no such row) or "running
  elsewhere" (a duplicate while another worker's lease is live).
"""

from __future__ import annotations

from typing import Any

TASK = "specdec.generate"
CANCEL_COMMAND = "specdec_cancel"
MAX_ATTEMPTS = 3
FINISHED = ("ok", "failed", "cancelled")


def queue_name(pair: str) -> str:
    """One queue per pair: a worker holds one pair and consumes its queue."""
    return f"specdec.{pair}"


def task_message(request_id: str, pair: str, *, enqueued_at: float | None) -> dict[str, Any]:
    """``send_task(TASK, **task_message(...))``'s arguments for the stored row ``request_id``
    of ``pair``: the task's ``generate(request_id, pair, enqueued_at=)`` (``enqueued_at``: the
    sender's ``time.time()``, for the row's queue wait)."""
    return {"args": [request_id, pair], "kwargs": {"enqueued_at": enqueued_at}, "queue": queue_name(pair)}
