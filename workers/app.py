"""The worker's Celery app: the project's Celery configuration (``specdec_llm.client.broker``,
shared with the client that sends), the task (``tasks.py``), the lease heartbeat
(``leases.LeaseStep``) and the remote-control command that announces a ``cancel --now``
(``protocol.CANCEL_COMMAND``: ``cancels.on_cancel``). ``celery -A workers.app worker`` works too."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

from typing import Any

from specdec_llm.client.broker import broker_display, celery_config, config_key, is_embedded
from specdec_llm.client.protocol import CANCEL_COMMAND, TASK, queue_name
from specdec_llm.settings import get_settings

__all__ = ["TASK", "broker_display", "get_app", "is_embedded", "queue_name"]

_apps: dict[tuple[Any, ...], Celery] = {}


def get_app() -> Celery:
    """The worker's Celery app for the current settings (one per configuration, made on first use)."""
    key = config_key()
    if key not in _apps:
        from celery import Celery
        from celery.worker.control import control_command

        from . import tasks  # noqa: F401  (registers the task on every app)
        from .cancels import on_cancel
        from .leases import LeaseStep

        # Celery's remote control: the main process of every worker runs it on a broadcast
        control_command(name=CANCEL_COMMAND, args=[("job_id", str), ("written", str)], signature="<job_id> [written]")(
            on_cancel
        )

        app = Celery("specdec", set_as_current=False)
        app.conf.update(celery_config(get_settings()))
        app.steps["consumer"].add(LeaseStep)  # heartbeats of held rows; requeues rows whose worker is gone
        _apps[key] = app
    return _apps[key]


def __getattr__(name: str) -> Celery:
    if name == "app":  # `celery -A workers.app ...`: made when asked for, not at import
        return get_app()
    raise AttributeError(name)
