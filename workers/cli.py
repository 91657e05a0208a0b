"""``specdec-llm worker``: the command, its options read and checked before Celery starts or
the pair loads (``worker``), and the Celery worker it runs (``start_worker``).

``register(app)`` adds the command to the CLI's Typer app. The CLI finds it through the
``specdec_llm.commands`` entry point group (``pyproject.toml``), so nothing in ``specdec_llm``
imports ``workers``: the arrows go one way (workers -> client). Importing this module is light
(Typer, the options): Celery, the task and the runtime load when the command runs."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from specdec_llm.cli_common import check_batching, check_device, fail, user_errors
from specdec_llm.client.broker import broker_display, is_embedded
from specdec_llm.client.cli import DeviceOpt, MaxBatchOpt, PairOpt, PriceOpt
from specdec_llm.client.protocol import queue_name
from specdec_llm.settings import get_settings

ConcurrencyOpt = Annotated[int, typer.Option(help="Pool processes, each holding the pair (1 per GPU)")]
QueuesOpt = Annotated[str | None, typer.Option(help="Comma-separated queues (default: specdec.<pair>)")]
CalibrateOpt = Annotated[
    bool,
    typer.Option(
        help="Also measure target-only and speculative tok/s on a short prompt at start (the pair's "
        "baseline for rows recorded before each request measured its own)"
    ),
]
MaxWaitOpt = Annotated[
    float | None,
    typer.Option(
        "--max-wait-ms",
        help="An idle worker waits this long for more requests to start a batch with "
        "(default: SPECDEC_MAX_WAIT_MS or 20)",
    ),
]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        help="Serve Prometheus metrics of every pool process on http://HOST:PORT/metrics "
        "(HOST: --metrics-host; prometheus_client multiprocess mode; folder: "
        "PROMETHEUS_MULTIPROC_DIR or a temporary one)",
    ),
]
MetricsHostOpt = Annotated[
    str,
    typer.Option(
        "--metrics-host",
        help="The address the metrics server binds: 0.0.0.0 (every interface, what a Prometheus "
        "server elsewhere scrapes), 127.0.0.1 (this machine only), or one interface's address",
    ),
]
EventsOpt = Annotated[
    bool,
    typer.Option(
        "--events",
        "-E",
        help="Send Celery task events (task-received, task-started, task-succeeded...) for monitors "
        "such as Flower or `celery events` (Celery's -E, worker_send_task_events)",
    ),
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def worker(
    pair: PairOpt = None,
    device: DeviceOpt = None,
    concurrency: ConcurrencyOpt = 1,
    queues: QueuesOpt = None,
    price_per_hour: PriceOpt = [],  # noqa: B006
    calibrate: CalibrateOpt = False,
    max_batch: MaxBatchOpt = None,
    max_wait_ms: MaxWaitOpt = None,
    metrics_port: MetricsPortOpt = None,
    metrics_host: MetricsHostOpt = "0.0.0.0",
    events: EventsOpt = False,
    loglevel: str = "INFO",
) -> None:
    """Start a worker: one pair on one device, consuming the pair's queue.

    --max-batch B > 1 decodes up to B requests as one batch: one process (Celery's threads
    pool, B task threads, at most B messages reserved) holding the pair once."""
    from specdec_llm import client, store
    from specdec_llm.pairs import check_pair_device, get_spec
    from specdec_llm.settings import get_settings

    with user_errors():
        spec = get_spec(pair or get_settings().default_pair)  # reads the registry only: no model, no CUDA
    max_wait_ms = get_settings().max_wait_ms if max_wait_ms is None else max_wait_ms
    batching = check_batching(get_settings().max_batch if max_batch is None else max_batch, concurrency)
    if max_wait_ms < 0:
        fail("max-wait-ms: use 0 or more")
    if metrics_port is not None and not 0 < metrics_port < 65536:
        fail(f"metrics-port: {metrics_port} is not a TCP port; use 1-65535")
    if loglevel.upper() not in LOG_LEVELS:  # (Celery's own refusal came after the start-up line, as two tracebacks)
        fail(f"loglevel: {loglevel!r} is not a log level; use one of {', '.join(LOG_LEVELS)}")
    if device is None:  # the pair's (or SPECDEC_DEVICE's): this machine must have it too
        with user_errors():
            check_pair_device(spec)
        device = spec.device
    else:
        check_device(device)
    with user_errors():  # before Celery starts or the pair loads
        client.check_broker_url()
        price = store.price_for(price_per_hour or None, device)  # the flag, else SPECDEC_PRICE_PER_HOUR
    raise typer.Exit(
        start_worker(
            spec.name,
            device=device,
            concurrency=concurrency,
            queues=queues,
            price_per_hour=price,
            calibrate=calibrate,
            max_batch=batching,
            max_wait_ms=max_wait_ms,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            events=events,
            loglevel=loglevel,
        )
    )


def register(app: typer.Typer) -> None:
    """Add ``worker`` to ``app`` (the ``specdec_llm.commands`` entry point)."""
    app.command()(worker)


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
    metrics_host: str = "0.0.0.0",
) -> int:
    """Run a Celery worker for ``pair`` on ``device`` until it stops; its exit status.

    --max-batch B > 1 decodes up to B requests as one batch: one process (Celery's threads
    pool, B task threads, at most B messages reserved) holding the pair once. ``events``:
    the worker sends Celery's task events (``-E``: task-received, -started, -succeeded...),
    for Flower, ``celery events`` or an ``app.events.Receiver``."""
    from specdec_llm.pairs import quiet_loading

    from . import runtime
    from .app import get_app

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
        _serve_metrics(pair, metrics_port, metrics_host)
    shape, pool_size = _pool_shape(options.pool, max_batch, max_wait_ms, concurrency)
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


def _serve_metrics(pair: str, port: int, host: str) -> None:
    """Serve the Prometheus metrics on ``host``:``port`` (one line and exit 2 if it cannot), and say where."""
    from . import metrics

    try:
        folder = metrics.serve(port, pair, queue_name(pair), addr=host)
    except OSError as e:
        fail(f"metrics-host/metrics-port: cannot serve on {host} port {port}: {e.strerror or e}")
    shown = f"[{host}]" if ":" in host else host
    print(
        f"specdec worker: Prometheus metrics on http://{shown}:{port}/metrics (multiprocess folder {folder})",
        file=sys.stderr,
    )


def _pool_shape(pool: str, max_batch: int | str, max_wait_ms: float, concurrency: int) -> tuple[str, int]:
    """How the worker's pool runs, in words, and its size: the threads pool is one process, B
    task threads feeding one batch (no fork: torch may load here); else ``concurrency`` processes."""
    if pool != "threads":
        return f"concurrency {concurrency}", concurrency
    from specdec_llm.engine.types import auto_cap

    cap = auto_cap(max_batch)
    size = max_batch if cap is None else f"the size measured fastest here (at most {cap})"
    shape = f"batches of up to {size} (threads pool, max wait {max_wait_ms:g} ms)"
    # auto: the server decodes as many rows as measured fastest (at most its cap); the rest wait their turn
    return shape, int(max_batch) if cap is None else cap


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
