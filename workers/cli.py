"""The worker side of ``specdec-llm worker``: its options are read and checked in
``specdec_llm/client/cli.py``, which calls ``start_worker`` (the only import of ``workers``
from ``specdec_llm``)."""

from __future__ import annotations

import os
import sys

from specdec_llm.cli_common import fail
from specdec_llm.client.broker import broker_display, is_embedded, queue_name
from specdec_llm.pairs import quiet_loading
from specdec_llm.settings import get_settings

from . import runtime
from .app import get_app


def start_worker(
    pair: str,
    *,
    device: str,
    concurrency: int,
    queues: str | None,
    price_per_hour: float | None,
    calibrate: bool,
    max_batch: int | str,
    max_wait_ms: float,
    metrics_port: int | None,
    loglevel: str,
    events: bool = False,
) -> int:
    """Run a Celery worker for ``pair`` on ``device`` until it stops; its exit status.

    --max-batch B > 1 decodes up to B requests as one batch: one process (Celery's threads
    pool, B task threads, at most B messages reserved) holding the pair once. ``events``:
    the worker sends Celery's task events (``-E``: task-received, -started, -succeeded...),
    for Flower, ``celery events`` or an ``app.events.Receiver``."""
    threads = None
    if device == "cpu" and concurrency > 1 and not get_settings().threads:
        threads = max(1, (os.cpu_count() or 1) // concurrency)  # share the cores, don't oversubscribe
    quiet_loading()
    options = runtime.WorkerOptions(
        pair,
        device=device,
        price_per_hour=price_per_hour,
        threads=threads,
        calibrate=calibrate,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        metrics_port=metrics_port,
    )
    runtime.configure(options)
    queue_list = queues or queue_name(pair)
    if metrics_port is not None:  # before the pool forks: its processes write where this one reads
        from . import metrics

        try:
            folder = metrics.serve(metrics_port, pair, queue_name(pair))
        except OSError as e:
            fail(f"metrics-port: cannot serve on port {metrics_port}: {e.strerror or e}")
        print(
            f"specdec worker: Prometheus metrics on http://0.0.0.0:{metrics_port}/metrics "
            f"(multiprocess folder {folder})",
            file=sys.stderr,
        )
    if options.pool == "threads":  # one process, B task threads feeding one batch (no fork: torch may load here)
        from specdec_llm.engine.serve import AUTO_CAP

        size = "the size measured fastest here" if max_batch == "auto" else max_batch
        shape = f"batches of up to {size} (threads pool, max wait {max_wait_ms:g} ms)"
        # auto: the server decodes as many rows as measured fastest (at most AUTO_CAP); the rest wait their turn
        pool_size = AUTO_CAP if max_batch == "auto" else max_batch
    else:
        shape, pool_size = f"concurrency {concurrency}", concurrency
    print(
        f"specdec worker: pair {pair} on {device}, queues {queue_list}, {shape}, broker {broker_display()}"
        + (", sending task events" if events else ""),
        file=sys.stderr,
    )
    argv = _celery_argv(pair, options.pool, pool_size, queue_list, loglevel, events)
    code = get_app().start(argv)  # (worker_main drops the exit status)
    if runtime.load_failed():  # a pool child (or this process) could not load the pair: not a clean stop
        print(f"error: worker stopped: could not load pair {pair} (see the CRITICAL line above)", file=sys.stderr)
        return runtime.LOAD_FAILED_EXIT
    return code or 0


def _celery_argv(pair: str, pool: str, pool_size: int, queues: str, loglevel: str, events: bool) -> list[str]:
    """``celery worker``'s arguments; ``events``: task events on (``-E``, worker_send_task_events)."""
    argv = [
        "worker",
        f"--loglevel={loglevel}",
        f"--concurrency={pool_size}",
        f"--queues={queues}",
        f"--hostname=specdec-{pair}-{os.getpid()}@%h",
        f"--pool={pool}",
        "--without-mingle",
        "--without-gossip",
    ]
    if events:
        argv.append("--task-events")
    if is_embedded():
        argv.append("--without-heartbeat")
    return argv
