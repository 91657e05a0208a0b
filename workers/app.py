"""The worker's Celery app: the project's Celery configuration (``specdec_llm.client.broker``,
shared with the client that sends), the task (``tasks.py``) and the lease heartbeat
(``leases.LeaseStep``). ``celery -A workers.app worker`` works too."""

from __future__ import annotations

from specdec_llm.client.broker import broker_display, celery_config, config_key, is_embedded
from specdec_llm.client.protocol import TASK, queue_name
from specdec_llm.settings import get_settings

__all__ = ["TASK", "broker_display", "get_app", "is_embedded", "queue_name"]

_apps: dict[tuple, object] = {}


def get_app():
    """The worker's Celery app for the current settings (one per configuration, made on first use)."""
    key = config_key()
    if key not in _apps:
        from celery import Celery

        from . import tasks  # noqa: F401  (registers the task on every app)
        from .leases import LeaseStep

        app = Celery("specdec", set_as_current=False)
        app.conf.update(celery_config(get_settings()))
        app.steps["consumer"].add(LeaseStep)  # heartbeats of held rows; requeues rows whose worker is gone
        _apps[key] = app
    return _apps[key]


def __getattr__(name: str):
    if name == "app":  # `celery -A workers.app ...`: made when asked for, not at import
        return get_app()
    raise AttributeError(name)
