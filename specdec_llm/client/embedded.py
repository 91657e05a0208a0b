"""The embedded broker's transport: kombu's filesystem transport with atomic hand-over
(``broker.celery_config`` names it when ``SPECDEC_BROKER_URL`` is unset; kombu imports it)."""

from __future__ import annotations

import os
import uuid
from queue import Empty  # (what kombu's filesystem channel raises: the standard library's)
from time import monotonic
from typing import Any

from celery.worker import state as worker_state
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads


class EmbeddedChannel(filesystem.Channel):
    """kombu's filesystem channel with atomic hand-over: a message is written to a hidden
    file and renamed into place, and a consumer claims one by renaming it (exactly one
    rename wins). Upstream writes in place and moves claimed files to /tmp, where a reader
    can catch a half-written file or two readers can copy the same one."""

    # (as filesystem.Channel._put, which renames AbstractChannel._put's `message`: kombu's own mismatch)
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        tmp = os.path.join(self.data_folder_out, f".{name}.tmp")
        with open(tmp, "wb") as f:
            f.write(str_to_bytes(dumps(payload)))
        os.replace(tmp, os.path.join(self.data_folder_out, name))

    def _get(self, queue: str, timeout: float | None = None) -> Any:
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
        raise Empty()


# s between looks at whether the worker was told to stop, while it waits for a message
STOP_CHECK_S = 0.05


def _stopping() -> bool:
    """Whether this process's Celery worker was told to stop (its own test: the flag may be 0)."""
    return any(
        flag is not None and flag is not False for flag in (worker_state.should_stop, worker_state.should_terminate)
    )


class EmbeddedTransport(filesystem.Transport):
    Channel = EmbeddedChannel

    def drain_events(self, connection: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """kombu's wait for a message, in slices of ``STOP_CHECK_S``, given up (as its timeout)
        once the worker was told to stop: Celery's worker loop waits here up to 2 s at a time
        before it looks (a local worker's warm shutdown took ~3 s beyond its last task)."""
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            left = STOP_CHECK_S if deadline is None else max(0.0, min(STOP_CHECK_S, deadline - monotonic()))
            try:
                return super().drain_events(connection, timeout=left, **kwargs)  # type: ignore[no-untyped-call]
            except TimeoutError:  # (socket.timeout, what kombu raises)
                if _stopping() or (deadline is not None and monotonic() >= deadline):
                    raise
