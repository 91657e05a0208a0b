"""The Celery app, configured from settings: ``SPECDEC_BROKER_URL``, ``SPECDEC_RESULT_BACKEND``
(the store is ``SPECDEC_DATABASE_URL``, read by the store itself).

Production: Redis as broker and result backend. Without ``SPECDEC_BROKER_URL`` the broker
is *embedded*: kombu's filesystem transport over ``<data_dir>/queue`` (one small file per
message, no server; any process on this machine that shares the data directory can
publish and consume), and results go to ``<data_dir>/results`` (Celery's file backend).

Task semantics for long GPU work: JSON only (a pickled message is refused, never
unpickled), late acks + reject on worker loss (a message is acknowledged only after its
result is written; a killed worker's message goes back to the queue), prefetch 1 (a
worker never sits on messages another could run), a Redis visibility timeout longer than
the hard time limit (a message is redelivered only when its worker is surely gone).

``SPECDEC_CELERY_CONFIG=some.module`` overrides any Celery setting with the module's
lowercase names (operations: TLS, Sentinel; tests: a short visibility timeout).
"""

from __future__ import annotations

import importlib
import os
import uuid
from datetime import timedelta
from time import monotonic

from celery import Celery
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

from specdec_llm.settings import Settings, get_settings

TASK = "specdec.generate"
SOFT_TIME_LIMIT = 3600  # s: the task is told (SoftTimeLimitExceeded) and fails its row
TIME_LIMIT = SOFT_TIME_LIMIT + 300  # s: the pool kills the process running it
VISIBILITY_TIMEOUT = 2 * TIME_LIMIT  # s: Redis redelivers an unacknowledged message after this
CONFIG_ENV = "SPECDEC_CELERY_CONFIG"

_apps: dict[tuple, Celery] = {}


def queue_name(pair: str) -> str:
    """One queue per pair: a worker holds one pair and consumes its queue."""
    return f"specdec.{pair}"


def is_embedded(settings: Settings | None = None) -> bool:
    return not (settings or get_settings()).broker_url


def broker_display(settings: Settings | None = None) -> str:
    """The broker for messages and logs, password hidden."""
    settings = settings or get_settings()
    if is_embedded(settings):
        return f"embedded (files in {settings.data_dir / 'queue'})"
    from kombu.utils.url import maybe_sanitize_url

    from specdec_llm.store.db import mask_query

    return mask_query(maybe_sanitize_url(settings.broker_url))  # user:pass@ and ?password=...


def celery_config(settings: Settings) -> dict:
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
    )
    if is_embedded(settings):
        queue = settings.data_dir / "queue"
        results = settings.data_dir / "results"
        for folder in (queue, queue / "control", results):
            folder.mkdir(parents=True, exist_ok=True)
        conf.update(
            broker_url="filesystem://localhost/",
            broker_transport=f"{__name__}:EmbeddedTransport",
            broker_transport_options={
                "data_folder_in": str(queue),
                "data_folder_out": str(queue),
                "control_folder": str(queue / "control"),
                "polling_interval": 0.002,  # s between looks at an empty queue folder (a listdir: cheap)
            },
            result_backend=settings.result_backend or f"file://{results}",
            worker_enable_remote_control=False,  # no broadcast over files: fewer folders to poll
        )
    else:
        broker = settings.broker_url
        backend = settings.result_backend or (broker if broker.startswith(("redis://", "rediss://")) else None)
        conf.update(
            broker_url=broker,
            result_backend=backend,
            broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
            result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT},
        )
    module = os.environ.get(CONFIG_ENV)
    if module:
        overrides = importlib.import_module(module)
        conf.update({k: v for k, v in vars(overrides).items() if k.islower() and not k.startswith("_")})
    return conf


def get_app() -> Celery:
    """The Celery app for the current settings (one per configuration, made on first use)."""
    settings = get_settings()
    key = (settings.broker_url, settings.result_backend, str(settings.data_dir), settings.default_pair,
           os.environ.get(CONFIG_ENV))  # fmt: skip
    if key not in _apps:
        from . import tasks  # noqa: F401  (registers the task on every app)

        from .leases import LeaseStep

        app = Celery("specdec", set_as_current=False)
        app.conf.update(celery_config(settings))
        app.steps["consumer"].add(LeaseStep)  # heartbeats of held rows; requeues rows whose worker is gone
        _apps[key] = app
    return _apps[key]


# -- the embedded broker -------------------------------------------------------------------
class EmbeddedChannel(filesystem.Channel):
    """kombu's filesystem channel with atomic hand-over: a message is written to a hidden
    file and renamed into place, and a consumer claims one by renaming it (exactly one
    rename wins). Upstream writes in place and moves claimed files to /tmp, where a reader
    can catch a half-written file or two readers can copy the same one."""

    def _put(self, queue, payload, **kwargs):
        name = f"{int(round(monotonic() * 1000))}_{uuid.uuid4()}.{queue}.msg"
        tmp = os.path.join(self.data_folder_out, f".{name}.tmp")
        with open(tmp, "wb") as f:
            f.write(str_to_bytes(dumps(payload)))
        os.replace(tmp, os.path.join(self.data_folder_out, name))

    def _get(self, queue):
        folder = self.data_folder_in
        for name in sorted(os.listdir(folder)):
            if name.startswith(".") or name.partition(".")[2] != f"{queue}.msg":
                continue
            claimed = os.path.join(folder, f".{name}.{os.getpid()}.claimed")
            try:
                os.rename(os.path.join(folder, name), claimed)
            except FileNotFoundError:  # another consumer won it
                continue
            with open(claimed, "rb") as f:
                payload = f.read()
            os.remove(claimed)
            return loads(bytes_to_str(payload))
        raise filesystem.Empty()


class EmbeddedTransport(filesystem.Transport):
    Channel = EmbeddedChannel


def __getattr__(name: str):
    if name == "app":  # `celery -A workers.app ...`: made when asked for, not at import
        return get_app()
    raise AttributeError(name)
