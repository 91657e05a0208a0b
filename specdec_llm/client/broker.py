"""Where the messages go: the Celery configuration both ends share, from settings:
``SPECDEC_BROKER_URL``, ``SPECDEC_RESULT_BACKEND`` (the store is ``SPECDEC_DATABASE_URL``,
read by the store itself). The task's name, its queues and its message are the job
protocol's (``protocol.py``).

The client sends by task name (``send_task``): it imports no task code, and Celery only
when it sends. The worker's app (``workers/app.py``) is this configuration plus the task
and the lease step.

Production: Redis as broker and result backend. Without ``SPECDEC_BROKER_URL`` the broker
is *embedded*: kombu's filesystem transport over ``<data_dir>/queue`` (one small file per
message, no server; any process on this machine that shares the data directory can
publish and consume; ``embedded.py``), and results go to ``<data_dir>/results`` (Celery's
file backend).

Task semantics for long GPU work: JSON only (a pickled message is refused, never
unpickled), late acks + reject on worker loss (a message is acknowledged only after its
result is written; a killed worker's message goes back to the queue), prefetch 1 (a
worker never sits on messages another could run), a Redis visibility timeout longer than
the hard time limit (a message is redelivered only when its worker is surely gone).

``SPECDEC_CELERY_CONFIG=some.module`` overrides any Celery setting with the module's
lowercase names (operations: TLS, Sentinel; tests: a short visibility timeout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

import importlib
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

from specdec_llm.errors import SpecDecError
from specdec_llm.settings import Settings, get_settings

from .protocol import CANCEL_COMMAND, queue_name

SOFT_TIME_LIMIT = 3600  # s: the task is told (SoftTimeLimitExceeded) and fails its row
TIME_LIMIT = SOFT_TIME_LIMIT + 300  # s: the pool kills the process running it
VISIBILITY_TIMEOUT = 2 * TIME_LIMIT  # s: Redis redelivers an unacknowledged message after this
CONFIG_ENV = "SPECDEC_CELERY_CONFIG"
URL_FIELDS = ("transport", "hostname", "port", "userid", "password", "virtual_host")  # kombu's, not a query's

_apps: dict[tuple[Any, ...], object] = {}
log = logging.getLogger(__name__)


class QueueError(SpecDecError, RuntimeError):
    """The broker cannot be reached (the rows, if any, are saved); the message says what to do."""


def is_embedded(settings: Settings | None = None) -> bool:
    return not (settings or get_settings()).broker_url


def broker_display(settings: Settings | None = None) -> str:
    """The broker for messages and logs, password hidden."""
    settings = settings or get_settings()
    if is_embedded(settings):
        return f"embedded (files in {settings.data_dir / 'queue'})"
    from specdec_llm.store.db import mask_userinfo

    return mask_userinfo(settings.broker_url or "")


def check_broker_url(settings: Settings | None = None) -> None:
    """Raise ``QueueError`` when kombu cannot read ``SPECDEC_BROKER_URL`` (before a row is
    written or a worker starts: kombu would fail later, with a traceback); the message shows
    the URL with its password hidden."""
    settings = settings or get_settings()
    url = settings.broker_url
    if not url:
        return
    from kombu.utils.url import url_to_parts

    from specdec_llm.store.db import mask_userinfo

    shown = mask_userinfo(url)
    how = "use scheme://[:PASSWORD@]host:port/db, e.g. redis://:PASSWORD@127.0.0.1:6379/0"
    try:
        parts = url_to_parts(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a port that is not a number (its text is not shown: it may hold the password)
        raise QueueError(f"SPECDEC_BROKER_URL: cannot read {shown}; {how}") from None
    try:
        from kombu.transport import resolve_transport

        resolve_transport(parts.scheme)
    except (KeyError, ImportError, ValueError):
        raise QueueError(f"SPECDEC_BROKER_URL: {shown}: no broker transport {parts.scheme!r}; {how}") from None
    clash = [key for key in URL_FIELDS if key in parts.query]
    if clash:
        example = (
            f"{parts.scheme}://{parts.username or ''}:PASSWORD@{parts.hostname or 'host'}{port}/{parts.path or ''}"
        )
        fix = (
            f"put the password in the URL's userinfo instead: {example}"
            if "password" in clash
            else "give it in the URL itself (scheme://user:PASSWORD@host:port/path) instead"
        )
        raise QueueError(f"SPECDEC_BROKER_URL: {shown} has {clash[0]}= in its query, which kombu cannot take; {fix}")


def celery_config(settings: Settings) -> dict[str, Any]:
    conf = dict(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_soft_time_limit=SOFT_TIME_LIMIT,
        task_time_limit=TIME_LIMIT,
        task_default_queue=queue_name(settings.default_pair),
        worker_proc_alive_timeout=900,  # a child loads its pair in worker_process_init (default 4 s)
        worker_cancel_long_running_tasks_on_connection_loss=True,  # they come back: acks are late
        broker_connection_retry_on_startup=True,
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 2},
        result_backend_always_retry=True,
        result_backend_max_retries=10,
        result_expires=timedelta(days=7),
        # the longest its timer thread sleeps, so the longest a warm shutdown waits for it (default 1 s)
        worker_timer_precision=0.1,
    )
    if is_embedded(settings):
        queue = settings.data_dir / "queue"
        results = settings.data_dir / "results"
        for folder in (queue, queue / "control", results):
            folder.mkdir(parents=True, exist_ok=True)
        conf.update(
            broker_url="filesystem://localhost/",
            broker_transport="specdec_llm.client.embedded:EmbeddedTransport",
            broker_transport_options={
                "data_folder_in": str(queue),
                "data_folder_out": str(queue),
                "control_folder": str(queue / "control"),
                "polling_interval": 0.002,  # s between looks at an empty queue folder (a listdir: cheap)
            },
            result_backend=settings.result_backend or f"file://{results}",
            # remote control on: a `cancel --now` broadcast reaches the workers through the
            # control folder's fanout table (each worker also polls its pidbox queue's files)
            worker_enable_remote_control=True,
        )
    else:
        check_broker_url(settings)
        broker = settings.broker_url or ""  # (check_broker_url: set, and one kombu reads)
        backend = settings.result_backend or (broker if broker.startswith(("redis://", "rediss://")) else None)
        conf.update(
            broker_url=broker,
            result_backend=backend,
            broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
            result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
        )
    conf.update(_overrides())
    return conf


def _overrides() -> dict[str, Any]:
    """The lowercase names of the module SPECDEC_CELERY_CONFIG names (none where it is unset)."""
    module = os.environ.get(CONFIG_ENV)
    if not module:
        return {}
    try:
        overrides = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - the user's module: any error is theirs, said in one line
        raise QueueError(
            f"{CONFIG_ENV}={module}: cannot import it ({type(e).__name__}: {e}); name an importable "
            "module (on PYTHONPATH) of lowercase Celery settings, or unset it"
        ) from None
    return {k: v for k, v in vars(overrides).items() if k.islower() and not k.startswith("_")}


def config_key() -> tuple[Any, ...]:
    """What a Celery app's configuration depends on (one app per distinct key)."""
    settings = get_settings()
    return (
        settings.broker_url,
        settings.result_backend,
        str(settings.data_dir),
        settings.default_pair,
        os.environ.get(CONFIG_ENV),
    )


def get_app() -> Celery:
    """A Celery app for the current settings that sends by task name (no task registered
    here; one per configuration, made on first use)."""
    key = config_key()
    if key not in _apps:
        from celery import Celery

        app = Celery("specdec", set_as_current=False)
        app.conf.update(celery_config(get_settings()))
        _apps[key] = app
    return _apps[key]


@contextmanager
def reaching(what: str = "", then: str = "") -> Iterator[None]:
    """kombu's OperationalError (the broker cannot be reached) as a ``QueueError`` that says
    what to do: "``what``: the broker at ... is unreachable (...); check ...``then``"."""
    from kombu.exceptions import OperationalError

    try:
        yield
    except OperationalError as e:
        raise QueueError(
            f"{what + ': ' if what else ''}the broker at {broker_display()} is unreachable ({e}); "
            f"check SPECDEC_BROKER_URL and that it is running{then}"
        ) from None


def check_broker() -> None:
    """Raise ``QueueError`` quickly when the broker cannot be reached."""
    with reaching(), get_app().connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, interval_start=0.2, interval_step=0.2, timeout=3)


def broadcast_cancel(job_id: str, written: datetime) -> bool:
    """Tell every worker that ``job_id`` (a job, or one row: a request id) was cancelled
    ``--now``, its flag ``written`` then
    (naive UTC) (Celery's remote control: ``CANCEL_COMMAND`` broadcast, no reply awaited);
    False when the broker cannot be reached. The store holds the cancel either way: a worker
    that misses this finds it at its next lease heartbeat, and at the start of each row."""
    try:
        check_broker()  # (a broadcast to a broker that is away would retry for as long as it is away)
        arguments = {"job_id": job_id, "written": written.isoformat()}
        get_app().control.broadcast(CANCEL_COMMAND, arguments=arguments)
        return True
    except Exception as e:  # noqa: BLE001 - the store has the cancel: workers find it by themselves
        log.warning("could not broadcast the cancel of %s (%s); workers find it in the store", job_id, e)
        return False


def live_workers(pair: str, timeout: float = 2.5) -> list[str]:
    """Names of the running workers that consume ``pair``'s queue (none over the embedded broker).
    ``timeout``: how long their replies may take; a worker on a loaded machine (every core busy
    decoding) took over 1 s, and a miss starts a needless local worker."""
    if is_embedded():
        return []
    with reaching():
        replies = get_app().control.inspect(timeout=timeout).active_queues() or {}
    return sorted(node for node, queues in replies.items() if any(q.get("name") == queue_name(pair) for q in queues))


def queue_size(pair: str) -> int | None:
    """Messages waiting in ``pair``'s queue (not those a worker has reserved); None when the
    broker cannot say."""
    try:
        with get_app().connection_for_read() as conn:
            # (not passive: Redis has no key for an empty queue, so a passive look says "not found")
            return int(conn.default_channel.queue_declare(queue=queue_name(pair)).message_count)
    except Exception:  # noqa: BLE001 - unknown: the caller does nothing
        return None
