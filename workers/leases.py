"""Leases: no row stays "running" after its worker is gone (store side: ``specdec_llm.store.jobs``).

- A task takes its row under a lease in the worker's Celery node name (``store.jobs.take``).
- ``LeaseStep``, a bootstep of every worker's consumer, runs on Celery's own worker timer
  (the one that drives its event heartbeats) in the worker's main process. Every
  ``SPECDEC_LEASE_HEARTBEAT_S`` seconds it renews the heartbeat of every row the worker
  holds (Celery's own record of the requests it has reserved or is running,
  ``celery.worker.state``), then requeues rows whose lease expired (``reclaim``). If the
  worker dies (SIGKILL, OOM killer, lost host) its rows' heartbeats stop, and after
  ``SPECDEC_LEASE_TIMEOUT_S`` any other worker (or a waiting ``run``) puts them back on
  the queue, exactly once (one atomic UPDATE picks each: ``client.reclaim_and_enqueue``).
- The same transaction that renews the held rows reads their jobs' cancel flags
  (``jobs.renew_leases``): a ``cancel --now`` whose broadcast this worker missed is announced
  to its processes here (``cancels.announce``), within one heartbeat.
- An idle worker (holding no row) also sends again the rows of its pair queued for longer
  than a lease timeout while the queue is empty (``client.resend_unsent``): their messages
  were lost (a worker killed between the broker handing one out and its row being taken, a
  broker restarted without persistence), and a job fed by ``submit`` has nobody else to.
- A late duplicate of the message (Redis redelivers an unacknowledged message after its
  visibility timeout; a message requeued by ``task_reject_on_worker_lost`` when a pool
  child died) finds the row finished (no-op) or running under another worker's live lease
  (left alone), never generating it twice.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps
from celery.worker import state

from specdec_llm.client.jobs import reclaim_and_enqueue, resend_unsent
from specdec_llm.client.protocol import TASK
from specdec_llm.settings import get_settings
from specdec_llm.store import jobs

from . import cancels, runtime

log = logging.getLogger(__name__)


def held_request_ids(task_name: str) -> set[str]:
    """Ids of the rows this worker holds: Celery's reserved and active requests of ``task_name``."""
    held = set()
    for req in [*state.reserved_requests, *state.active_requests]:
        if req.task_name == task_name and req.args:
            held.add(str(req.args[0]))
    return held


class LeaseStep(bootsteps.StartStopStep):
    """Consumer bootstep: heartbeats for the rows this worker holds, and requeueing of rows
    whose worker is gone, on the worker's timer."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:  # c: Celery's consumer
        self.tref = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        interval = get_settings().lease_heartbeat_s
        self.tref = c.timer.call_repeatedly(interval, self.beat, (c,), priority=10)

    def stop(self, c: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    shutdown = stop

    def beat(self, c: Any) -> None:
        try:
            held = held_request_ids(TASK)
            if jobs.renew_leases(held, c.hostname):  # a held row's job was cancelled --now
                cancels.announce()
            reclaim_and_enqueue()
            pair = runtime.configured_pair()
            if not held and pair is not None and not runtime.load_failed():  # idle: rows waiting on a lost message?
                resend_unsent(pair)
        except Exception as e:  # noqa: BLE001 - the database or broker is away: the next beat tries again
            log.warning("lease heartbeat failed (%s: %s); the next one tries again", type(e).__name__, e)
