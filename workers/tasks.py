"""The one task: generate the completion of one stored request and record it.

``specdec.generate(request_id, pair, enqueued_at=None)``. The request row (prompt or chat
messages, parameters) is read from the store, so a message is a few ids, not data.

- Idempotent: a row already finished (ok, failed, cancelled) is a no-op, so a redelivered
  message costs one read; the result write itself is idempotent on the request id.
- The generation itself goes through the process's ``BatchServer`` (``runtime``): the task
  submits its request and waits for its Future. With ``--max-batch B`` > 1 (threads pool)
  up to B task threads' requests decode as one batch; with B = 1 (prefork) the server has
  one row at a time. Same code either way.
- Bad input (``RequestError``: bad parameters, prompt too long...) fails the row with its
  error, no retry. A time-out fails the row too: the request's deadline is the task's
  soft time limit (Celery's own soft limit does not work in the threads pool; the server
  drops a row past its deadline with TimeoutError).
- Transient faults (database or broker unreachable) retry with exponential backoff and
  jitter; a failure writing the result retries the write alone, carrying the result in
  the message, so a GPU never generates the same row twice for a database hiccup.
- The row is taken and read in one store transaction (``store.jobs.start``), under a lease
  (``workers.leases``): the worker's heartbeat keeps it;
  a row whose worker dies goes back to the queue by itself. A duplicate message for a
  row running under another worker's live lease is left alone; one for a row another task
  thread or prefork child of this worker is generating is dropped (``generating_here``).
- A row whose deliveries keep dying mid-generation (OOM-killed worker) fails after
  ``MAX_ATTEMPTS`` instead of killing workers forever.
- ``cancel JOB --now``: the row's stop check (``cancels``: told by a broadcast, or by the
  job's flag read with the row) ends it at its next iteration as cancelled, its partial text
  kept (``store.jobs.end_cancelled``); the batch's other rows go on.
- A row whose params hold ``"_stream": true`` (LangChain ``.stream``) publishes its text
  delta by delta while it is generated (``specdec_llm.client.streams``: ``StreamWriter``
  here, ``follow_stream`` in the caller).
- The row -> request step is the client's own (``specdec_llm.client.rows.build_request``),
  so LangChain's local mode builds the same request without this module.
- Returns plain JSON: ``{"request_id", "status", ...}`` plus text, token_ids,
  finish_reason and stats when ok, ``error`` when failed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu.exceptions
from celery import Task, shared_task
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from celery.utils.time import get_exponential_backoff_interval

from specdec_llm import store
from specdec_llm.client.protocol import FINISHED, MAX_ATTEMPTS, TASK, task_message
from specdec_llm.client.rows import build_request
from specdec_llm.client.streams import StreamWriter
from specdec_llm.engine import RequestError
from specdec_llm.settings import get_settings
from specdec_llm.store import jobs

from . import cancels, heartbeat, metrics, runtime

log = logging.getLogger(__name__)
# a lock file per row being generated, per worker node: a second message for one of them (a
# resumed `run`, a `retry`, a redelivery), in another task thread or prefork child of the node,
# is dropped, not decoded again beside it under the same lease owner (the node's name)
ROWS_DIR = Path(tempfile.gettempdir()) / f"specdec-llm-rows-{os.getuid()}"  # (per user: /tmp is shared)

TRANSIENT: tuple[type[BaseException], ...] = (
    *store.TRANSIENT_ERRORS,  # the database away or locked for a moment (the store names them)
    kombu.exceptions.OperationalError,
    ConnectionError,
    TimeoutError,
)
try:
    import redis.exceptions

    TRANSIENT += (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
except ImportError:  # pragma: no cover
    pass

MAX_RETRIES = 12
BACKOFF_MAX = 60  # s


class GenerateTask(Task):
    def on_failure(
        self, exc: BaseException, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any], einfo: Any
    ) -> None:
        """Out of retries or an unexpected error: the row fails with it (if the store lets us),
        unless it is no longer this worker's (cancelled, finished, or run by another meanwhile)."""
        request_id = str(args[0] if args else kwargs.get("request_id"))
        try:
            error = f"{type(exc).__name__}: {exc}"
            store.mark_request(request_id, "failed", error=error, held_by=self.request.hostname)
        except Exception as e:  # noqa: BLE001 - the store is what failed; `retry JOB` recovers the row
            log.error("could not mark request %s failed: %s", request_id, e)


@shared_task(
    name=TASK,
    bind=True,
    base=GenerateTask,
    acks_late=True,
    reject_on_worker_lost=True,
    autoretry_for=TRANSIENT,
    max_retries=MAX_RETRIES,
    retry_backoff=1,
    retry_backoff_max=BACKOFF_MAX,
    retry_jitter=True,
    resultrepr_maxsize=160,  # the worker log shows the start of each result, not all its token ids
)
def generate(
    self: Task, request_id: str, pair: str, enqueued_at: float | None = None, result: dict[str, Any] | None = None
) -> dict[str, Any]:
    started, clock = time.time(), time.monotonic()
    if not runtime.serves(pair):  # routed to a worker of another pair: pass it on
        self.app.send_task(TASK, **task_message(request_id, pair, enqueued_at=enqueued_at))
        return {"request_id": request_id, "status": "forwarded"}
    with generating_here(self.request.hostname or socket.gethostname(), request_id) as mine:
        if not mine:
            log.info("request %s: another message for a row this worker is generating; dropped", request_id)
            return {"request_id": request_id, "status": "running here", "duplicate": True}
        return _run(self, request_id, pair, enqueued_at, result, started, clock)  # (until its result is written)


@contextlib.contextmanager
def generating_here(node: str, request_id: str) -> Iterator[bool]:
    """Whether this task may generate ``request_id``: True unless another task thread or
    process of this worker ``node`` is generating it (its lease is the node's, so the store
    cannot tell them apart). An exclusive ``flock`` on a file per row: the kernel releases it
    when its process dies, so a redelivery after a killed child takes the row again."""
    fd = _row_lock(node, request_id)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(_lock_path(node, request_id))
            os.close(fd)


def _lock_path(node: str, request_id: str) -> Path:
    """One file per node, store and row: a row id is unique within its store only, so two
    stores' workers on one host (or two test processes) holding rows of one id are not one row."""
    row = f"{get_settings().effective_database_url}\n{request_id}"  # (hashed: no password in a file name)
    node_hash, row_hash = (hashlib.sha256(text.encode()).hexdigest()[:24] for text in (node, row))
    return ROWS_DIR / node_hash / f"{row_hash}.lock"


def _row_lock(node: str, request_id: str) -> int | None:
    """The locked file's descriptor; None when another holds it; -1 when no lock can be made
    here (an unwritable temporary folder: the store's lease alone guards the row)."""
    path = _lock_path(node, request_id)
    try:
        _own_folder(ROWS_DIR)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        while True:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(path).st_ino:  # not one its last holder just removed
                    return fd
            os.close(fd)
    except OSError as e:
        log.warning("no row lock in %s (%s); duplicate messages rely on the store's lease", ROWS_DIR, e)
        return -1


def _own_folder(folder: Path) -> None:
    """Makes ``folder`` (mode 0700) or checks that it is this user's own and no one else's to
    write: another user who made it first could hold a row's lock and have the row dropped."""
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is not a folder of this user's that only it can write")


def _run(
    self: Task,
    request_id: str,
    pair: str,
    enqueued_at: float | None,
    result: dict[str, Any] | None,
    started: float,
    clock: float,
) -> dict[str, Any]:
    """``generate``'s work on a row of its pair: take and generate it (unless a retry brings
    its result), then write the result."""
    if result is None:
        try:
            rt = runtime.get(pair)
        except Exception as e:  # noqa: BLE001 - not the row's fault: put it back, stop this worker
            runtime.stop_worker(runtime.load_error_text(pair, e))
            raise Reject(f"pair {pair} unavailable here", requeue=True) from None
        result, ended = _take_and_generate(self, request_id, rt, pair, clock)
        if ended is not None:
            return ended
        result["queue_wait_s"] = started - enqueued_at if enqueued_at else None
    if "by" not in result:  # who generated it: a retried write, which any worker may take, records them
        rt = runtime.get(pair)
        result["by"] = {
            "worker": rt.worker,
            "device": rt.device,
            "price_per_hour": rt.price_per_hour,
            "dtype": rt.dtype,
        }
    try:
        wrote = store.record_result(
            request_id,
            result,
            queue_wait_s=result.get("queue_wait_s"),
            pair=pair,
            job_id=result.get("job_id"),
            **result["by"],
        )
    except TRANSIENT as e:
        countdown = get_exponential_backoff_interval(1, self.request.retries, BACKOFF_MAX, full_jitter=True)
        log.warning("request %s: cannot write its result yet (%s); retrying in %s s", request_id, e, countdown)
        raise self.retry(exc=e, countdown=countdown, kwargs={"enqueued_at": enqueued_at, "result": result}) from e
    if not wrote:  # another worker finished the row first (this one's lease was taken over):
        # the row's result is the store's, which a sampled row's second generation is not
        row = store.get_request(request_id)
        return _finished(row) if row else {"request_id": request_id, "status": "missing"}
    heartbeat.meter.add(int(result["stats"].get("output_tokens") or 0))  # (counted once, as stored)
    metrics.record(pair, result["stats"], result.get("queue_wait_s"))
    return {
        "request_id": request_id,
        "status": "ok",
        **{k: result[k] for k in ("text", "token_ids", "finish_reason", "stats")},
    }


def _take_and_generate(
    task: Task, request_id: str, rt: runtime.Runtime, pair: str, clock: float
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Take the row (read with its job's cancel flag in one transaction) and generate it:
    ``(result, None)``, or ``(row, what the task returns)`` where it ended otherwise."""
    owner = task.request.hostname or f"{rt.worker['host']}:{rt.worker['pid']}"
    lease_timeout_s = get_settings().lease_timeout_s
    row = jobs.start(request_id, owner, lease_timeout_s=lease_timeout_s, max_attempts=MAX_ATTEMPTS, worker=rt.worker)
    if row is None:
        log.warning("request %s is not in the store; nothing to do", request_id)
        return {}, {"request_id": request_id, "status": "missing"}
    if not row["taken"]:
        return {}, _not_taken(request_id, row)
    result, ended = _generate_row(task, row, rt, pair, clock)
    if ended is None:
        result["job_id"] = row["job_id"]
    return result, ended


def _not_taken(request_id: str, row: dict[str, Any]) -> dict[str, Any]:
    """What the task says of a row it could not take: finished (a redelivered message, or
    cancelled meanwhile), failed now (running, its worker lost every time), or running elsewhere."""
    if row["status"] == "cancelled" and row.get("row_cancel_requested_at"):
        raise Ignore()  # (cancelled alone while queued: its caller stopped waiting, no result kept)
    if row["status"] in FINISHED:
        return _finished(row)
    if row["attempts"] >= MAX_ATTEMPTS:
        error = (
            f"gave up after {row['attempts']} attempts that ended without a result "
            "(the worker died each time: out of memory?)"
        )
        store.mark_request(request_id, "failed", error=error)
        return {"request_id": request_id, "status": "failed", "error": error}
    return {"request_id": request_id, "status": "running elsewhere", "duplicate": True}


def _generate_row(
    task: Task, row: dict[str, Any], rt: runtime.Runtime, pair: str, clock: float
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Generate a taken row through the process's BatchServer: ``(result, None)``, or
    ``({}, what the task returns)`` when the row ended otherwise: failed (bad input, time-out)
    or cancelled mid-way (``cancel --now``: the server asks ``cancels.flags`` before each
    step; the row's partial text is kept)."""
    request_id, job_id = row["id"], row.get("job_id")
    stream = StreamWriter(request_id, row["attempts"]) if (row.get("params") or {}).get("_stream") else None
    keys = (job_id, request_id) if job_id else (request_id,)  # its job's cancel, or its own
    stop = cancels.flags.watch(
        keys, {job_id: row.get("cancel_requested_at"), request_id: row.get("row_cancel_requested_at")}
    )
    limit = soft_time_limit(task)
    ended = "failed"  # how the attempt ended, its stream's end says (ok, cancelled, failed...)
    try:
        req = build_request(row, rt.loaded.tokenizer)
        # on_text (the stream) and stop are called from the server's thread
        with metrics.running(pair):
            future = rt.server.submit(req, on_text=stream, deadline=clock + limit if limit else None, stop=stop)
            res = future.result()
            # a constrained row out of tokens fails alone, saying so; a LangChain call's reply is
            # returned as it is (its parsers report it, and include_raw keeps the reply)
            if (why := res.incomplete()) and (row.get("params") or {}).get("_source") != "langchain":
                raise RequestError("response_format", why)
            result = res.to_dict()
            ended = "cancelled" if result["finish_reason"] == "cancelled" else "ok"
    except RequestError as e:
        metrics.failed(pair, "bad_input")
        error = str(e)
        if e.field == "prompt" and row.get("messages") is not None:  # (its prompt: the messages, rendered)
            error = f"messages: as the chat template renders them, {error.partition(': ')[2]}"
        store.mark_request(request_id, "failed", error=error)
        return {}, {"request_id": request_id, "status": "failed", "error": error}
    except (SoftTimeLimitExceeded, TimeoutError):  # prefork's signal, or the server's deadline
        metrics.failed(pair, "timeout")
        error = f"timed out: generation took longer than the {limit} s limit"
        store.mark_request(request_id, "failed", error=error)
        return {}, {"request_id": request_id, "status": "failed", "error": error}
    finally:
        if (raised := sys.exc_info()[1]) is not None:  # (raised anywhere, a failure's handler included)
            ended = _attempt_ended(task, raised)
        if stream:
            stream.close(ended)
        cancels.flags.release(keys)
    if result["finish_reason"] == "cancelled":
        jobs.end_cancelled(request_id, result, iterations_after=stop.iterations_after)
        if request_id in stop.by:  # cancelled alone: its caller stopped waiting, no one reads a result
            raise Ignore()  # (none kept in the result backend; a waiter reads the store)
        return {}, {
            "request_id": request_id,
            "status": "cancelled",
            "text": result["text"],
            "finish_reason": "cancelled",
        }
    return result, None


def _attempt_ended(task: Task, e: BaseException) -> str:
    """How an attempt that raised ``e`` ended, for its stream's reader: a transient fault its
    task retries (autoretry, while it has retries left: another attempt streams the row again),
    and the process stopping (not an ``Exception``: its row is delivered again), are "retry"
    (the reader waits for the next attempt, or for the task's end); any other error fails the
    row (``GenerateTask.on_failure``)."""
    if not isinstance(e, Exception):
        return "retry"
    if isinstance(e, TRANSIENT) and (task.max_retries is None or task.request.retries < task.max_retries):
        return "retry"
    return "failed"


def soft_time_limit(task: Task) -> float | None:
    """Seconds this delivery may generate: the message's own soft limit, else the task's,
    else the app's (``task_soft_time_limit``)."""
    _, soft = task.request.timelimit or (None, None)
    limit = soft or task.soft_time_limit or task.app.conf.task_soft_time_limit
    return None if limit is None else float(limit)


def _finished(row: dict[str, Any]) -> dict[str, Any]:
    out = {"request_id": row["id"], "status": row["status"], "duplicate": True}
    if row["status"] == "ok" and row.get("output"):
        out.update(
            text=row["output"]["text"],
            token_ids=row["output"]["token_ids"],
            finish_reason=row["output"]["finish_reason"],
        )
    elif row.get("error"):
        out["error"] = row["error"]
    return out
