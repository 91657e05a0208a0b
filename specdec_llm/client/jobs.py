"""Bulk jobs, the client's side: submit, enqueue, status, results, retry, cancel, wait.

Plain dicts in and out; the CLI (``client/cli.py``) only prints them. Every job is first
persisted (``store.create_job``: one row per input row, bad rows already failed), then
enqueued (one message per row on the pair's queue, sent by task name: ``broker.py``). A
job's id is derived from the file's content, the pair and the parameters, and each row's id
from the job id and its position, so submitting the same thing again resumes it instead of
duplicating it. Every read and write of the rows is a ``specdec_llm.store`` function.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from specdec_llm import store
from specdec_llm.engine import RequestError
from specdec_llm.settings import get_settings
from specdec_llm.store import PENDING as PENDING  # (the client exports it)
from specdec_llm.store import jobs
from specdec_llm.store.jobs import job_requests as job_requests  # (the client exports it)

from . import rows as R
from .broker import QueueError, broadcast_cancel, check_broker_url, get_app, queue_size, reaching
from .local import LocalWorker, log_tail
from .protocol import FINISHED, MAX_ATTEMPTS, TASK, task_message

log = logging.getLogger(__name__)

RESULT_FIELDS = (
    "id",
    "status",
    "text",
    "finish_reason",
    "error",
    "prompt_tokens",
    "output_tokens",
    "tokens_per_s",
    "acceptance_rate",
    "mean_accepted_length",
    "wall_time_s",
    "time_to_first_token_s",
    "metadata",
    "parsed",
)


# -- submit -----------------------------------------------------------------------------------
def submit(
    path: Path, pair: str, params: dict[str, Any] | None = None, *, name: str | None = None, hold_s: float | None = None
) -> dict[str, Any]:
    """Persist every row of ``path`` as a job for ``pair``, then enqueue the rows still to do.
    ``hold_s``: the job is also held that long against ``prune``, from the same transaction
    (``run`` does, then keeps it held with ``holding``).

    Raises ``InputError`` (unreadable file), ``RequestError`` (unknown pair, bad job-level
    parameters) or ``StoreError``; bad rows fail alone. Returns ``{"job_id", "rows",
    "created", "bad", "enqueued", "done", "cancelled", "name"}`` (cancelled rows count as done and
    are not run again: ``retry(job_id, cancelled=True)`` runs them).
    """
    from specdec_llm.pairs import get_spec  # (torch: not for commands that only read)

    params = R.stop_as_list({k: v for k, v in (params or {}).items() if v is not None})
    spec = get_spec(pair)  # unknown pair: fail now, not in a worker
    if params.get("drafter") is not None:
        spec.check_drafter(params["drafter"])  # one the pair has (as `generate` checks it)
    check_broker_url()  # a URL kombu cannot read: fail now, not with the rows saved
    R.check_params(params)
    name = _job_name(name, Path(path))
    rows = R.read_rows(Path(path))
    R.check_rows(rows, params)
    job_id = R.job_id_for(Path(path), pair, params)
    created = store.create_job(
        [R.to_request(job_id, r, params) for r in rows],
        name=name,
        pair=pair,
        params=params,
        job_id=job_id,
        hold_s=hold_s,
    )
    status = {r["id"]: r["status"] for r in job_requests(job_id, outputs=False)}
    pending = {rid for rid, st in status.items() if st in PENDING}  # new or lost
    todo, bad = [], 0
    for r, rid in zip(rows, (R.request_id(job_id, r) for r in rows)):
        bad += r.error is not None
        if r.error is not None and rid in pending:
            store.mark_request(rid, "failed", error=f"line {r.line}: {r.error}")
        elif rid in pending:
            todo.append(rid)
    _enqueue_job(job_id, todo, pair)
    return {
        "job_id": job_id,
        "rows": len(rows),
        "created": created["created"],
        "bad": bad,
        "enqueued": len(todo),
        "done": len(rows) - len(todo) - bad,
        "cancelled": sum(st == "cancelled" for st in status.values()),  # of "done": they stay cancelled
        "name": (store.get_job(job_id) or {}).get("name", name),  # (a job that existed keeps its name)
    }


def _job_name(name: str | None, path: Path) -> str:
    """The job's name: ``name``, or the file's name (cut to what a store holds). A given name
    too long to store, or with a NUL character, is refused (``RequestError`` naming it)."""
    if not name:
        return path.name[: store.MAX_JOB_NAME_CHARS]
    if len(name) > store.MAX_JOB_NAME_CHARS:
        raise RequestError(
            "name",
            f"{len(name):,} characters, over the {store.MAX_JOB_NAME_CHARS}-character limit of a job name; "
            "give a shorter --name",
        )
    if "\x00" in name:
        raise RequestError("name", "contains a NUL character (\\x00), which no store accepts; remove it from --name")
    return name


def enqueue(request_ids: list[str], pair: str, *, keep_results: bool = False, check_pair: bool = True) -> list[Any]:
    """One message per request on the pair's queue (rows must already be in the store).

    Bulk jobs read their results from the store, so by default the workers do not also
    put them in the result backend; ``keep_results=True`` does (for ``AsyncResult.get()``),
    and returns the AsyncResults. A pair this registry does not know is refused
    (``RequestError`` naming the known pairs): its queue would have no consumer.
    (``check_pair=False``: rows already accepted once, requeued by a worker whose own
    registry may differ.)"""
    if check_pair:
        from specdec_llm.pairs import get_spec

        get_spec(pair)
    app, now = get_app(), time.time()
    sent = []
    with app.producer_or_acquire() as producer:
        for rid in request_ids:
            message = task_message(rid, pair, enqueued_at=now)
            sent.append(app.send_task(TASK, **message, producer=producer, ignore_result=not keep_results))
    return sent


def _enqueue_job(job_id: str, request_ids: list[str], pair: str) -> None:
    with reaching(f"job {job_id} is saved but cannot be enqueued", f", then run `specdec-llm retry {job_id}`"):
        enqueue(request_ids, pair)


# -- holding a job against prune -----------------------------------------------------------------
JOB_HOLD_S = 120.0  # s: a hold not renewed ends after this (a `run` killed outright lets go of its job)


@contextmanager
def holding(job_id: str, *, hold_s: float = JOB_HOLD_S) -> Iterator[None]:
    """Hold ``job_id`` against ``prune`` while the block runs (``store.hold_job``): a command
    still using the job (``run``, until its results file is written) keeps it, whether or not
    its rows are finished. Renewed from a thread every ``SPECDEC_LEASE_HEARTBEAT_S`` (at most a
    third of ``hold_s``), released at the end; a store away for a moment is tried again at the
    next renewal, and a process killed outright lets go when the hold ends (``hold_s``)."""
    store.hold_job(job_id, hold_s)
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(min(get_settings().lease_heartbeat_s, hold_s / 3)):
            try:
                store.hold_job(job_id, hold_s)
            except Exception as e:  # noqa: BLE001 - the store is away: the next renewal tries again
                log.debug("job %s: renewing its hold: %s", job_id, e)

    renewer = threading.Thread(target=renew, name=f"hold-{job_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        try:
            store.release_job(job_id)
        except store.TRANSIENT_ERRORS as e:  # it ends by itself after hold_s
            log.warning("job %s: cannot release its hold now (%s); it ends within %g s", job_id, e, hold_s)


# -- reading a job -----------------------------------------------------------------------------
def job_counts(job_id: str, *, leases: bool = False) -> dict[str, int]:
    """Rows by state; ``leases``: also ``lost`` (running, lease expired: about to be
    requeued) and ``requeued`` (pending again after their worker was lost)."""
    counts = jobs.counts(job_id, lease_timeout_s=get_settings().lease_timeout_s)
    return counts if leases else {k: counts[k] for k in (*PENDING, *FINISHED)}


def get_job(job_id: str) -> dict[str, Any]:
    store.check_schema()
    job = store.get_job(job_id)
    if job is None:
        raise store.StoreError(f"no job {job_id!r} in {store.mask_url(get_settings().effective_database_url)}")
    return job


def status(job_id: str, price_per_hour: object = None) -> dict[str, Any]:
    """Counts by state, progress, speed, acceptance and cost so far, and an ETA."""
    from specdec_llm.store import summary

    job = get_job(job_id)
    counts = job_counts(job_id, leases=True)
    lost, requeued = counts.pop("lost"), counts.pop("requeued")
    total = sum(counts.values())
    done = sum(counts[s] for s in FINISHED)
    report = summary(job=job_id, group_by=(), price_per_hour=price_per_hour)
    rep = report[0] if report else {}
    elapsed = ((job["finished_at"] or store.utcnow()) - job["started_at"]).total_seconds() if job["started_at"] else 0.0
    ran = done - (jobs.refused_count(job_id) if counts["failed"] else 0)  # (rows refused at submit never ran)
    rate = ran / elapsed if elapsed > 0 and ran > 0 else None
    return {
        "job_id": job_id,
        "name": job["name"],
        "status": job["status"],
        "total": total,
        "counts": counts,
        "progress": done / total if total else 1.0,
        "elapsed_s": elapsed,
        "lost": lost,
        "requeued": requeued,
        # no ETA while a row's worker is gone and its row not yet requeued (it would be a false one)
        "eta_s": None if lost else (total - done) / rate if rate and total > done else (0.0 if total == done else None),
        "output_tokens": rep.get("output_tokens", 0),
        "throughput_tokens_per_s": rep.get("output_tokens", 0) / elapsed if elapsed > 0 else None,
        "tokens_per_s_mean": rep.get("tokens_per_s_mean"),
        "acceptance_rate": rep.get("acceptance_rate"),
        "mean_accepted_length": rep.get("mean_accepted_length"),
        "speedup": rep.get("speedup"),
        "speedup_basis": rep.get("speedup_basis"),
        "cost_usd": rep.get("cost_usd"),
    }


def results(job_id: str, *, failed_only: bool = False) -> list[dict[str, Any]]:
    """One dict per row, in input order (``failed_only``: the failed rows only): the row's
    id, outcome and key stats (``RESULT_FIELDS``,
    what the jsonl and csv formats write), and what the openai format adds: ``request_id``,
    ``pair``, ``endpoint`` (an OpenAI Batch line's url), ``chat``, ``refused`` (bad input,
    failed at submit), ``finished_at``, more telemetry (``openai_batch.TELEMETRY``) and
    ``baseline_s`` (the speedup's counterfactual)."""
    from .openai_batch import TELEMETRY, user_error

    get_job(job_id)
    out = []
    for r in job_requests(job_id):
        if failed_only and r["status"] != "failed":
            continue
        params = r["params"] or {}
        item = {k: r.get(k) for k in (*RESULT_FIELDS, *TELEMETRY)}
        item["id"] = params.get("_id", r["id"])
        item["parsed"] = parsed(item.get("text"), params.get("response_format")) if r["status"] == "ok" else None
        item["metadata"] = params.get("_metadata")
        if params.get("_endpoint") and item["error"]:  # an OpenAI Batch line's: in its own terms
            item["error"] = user_error(item["error"], params.get("_spelled"))
        if not item.get("draft_tokens_proposed"):  # nothing drafted: no rate (as status and report say), not 0%
            item["acceptance_rate"] = None
        item.update(
            request_id=r["id"],
            pair=r["pair"],
            endpoint=params.get("_endpoint"),
            chat=params.get("chat") or bool(r.get("messages_row")),  # a text prompt as a turn, or messages
            refused=bool(params.get("_input_error")),
            finished_at=r["finished_at"],
            baseline_s=r.get("baseline_s"),
        )
        out.append(item)
    return out


def parsed(text: str | None, fmt: dict[str, Any] | None) -> Any:
    """A JSON response format's output as the object it is (None for other rows)."""
    if text is None or not fmt or fmt.get("type") not in ("json_schema", "json_object"):
        return None
    try:
        return json.loads(text)
    except ValueError:  # (a complete constrained output always parses; a row written before it did not)
        return None


FORMATS = ("jsonl", "csv", "openai")


def write_results(items: list[dict[str, Any]], fmt: str, out: TextIO) -> None:
    """``jsonl``: one object per line (``RESULT_FIELDS``); ``csv``: one row per result,
    metadata as JSON text; ``openai``: OpenAI Batch output lines (``openai_batch.output_line``)."""
    if fmt == "jsonl":
        for item in items:
            out.write(json.dumps({k: item[k] for k in RESULT_FIELDS}, ensure_ascii=False) + "\n")
    elif fmt == "csv":
        import csv

        writer = csv.DictWriter(out, fieldnames=RESULT_FIELDS, lineterminator="\n", extrasaction="ignore")
        writer.writeheader()
        for item in items:
            as_text = {k: None if item[k] is None else json.dumps(item[k]) for k in ("metadata", "parsed")}
            writer.writerow({**item, **as_text})
    elif fmt == "openai":
        from .openai_batch import output_line

        for item in items:
            out.write(json.dumps(output_line(item), ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"format: {fmt!r} unknown; use {', '.join(FORMATS)}")


# -- retry and cancel --------------------------------------------------------------------------
def retry(job_id: str, *, cancelled: bool = False) -> dict[str, Any]:
    """Re-enqueue failed rows (not those refused at submit: they would fail again) and lost
    ones (queued: a message lost with its broker; running with an expired lease: a worker
    lost), in one UPDATE; ``cancelled``: cancelled rows too (else they stay cancelled, and
    ``"cancelled"`` says how many). Rows running under a live lease are left to their worker."""
    get_job(job_id)
    check_broker_url()
    rows = jobs.requeue(job_id, lease_timeout_s=get_settings().lease_timeout_s, cancelled=cancelled)
    by_pair: dict[str, list[str]] = {}
    for r in rows:
        by_pair.setdefault(r["pair"], []).append(r["id"])
    for pair, ids in by_pair.items():
        _enqueue_job(job_id, ids, pair)
    return {
        "job_id": job_id,
        "enqueued": len(rows),
        "bad_input": jobs.refused_count(job_id),
        "cancelled": 0 if cancelled else jobs.counts(job_id)["cancelled"],
    }


def cancel(job_id: str, *, now: bool = False) -> dict[str, Any]:
    """Rows not started are cancelled, in one UPDATE (workers skip them); a row being
    generated finishes, unless ``now``: then its worker ends it at its next iteration as
    cancelled, keeping its partial text. Returns ``{"job_id", "cancelled", "stopping",
    "finished"}`` (``stopping``: running rows told to stop; ``finished``: the job had no row
    left to run, and nothing was changed)."""
    if get_job(job_id)["status"] == "done":
        return {"job_id": job_id, "cancelled": 0, "stopping": 0, "finished": True}
    written = store.utcnow()
    cancelled = jobs.cancel(job_id, now=now, at=written)
    if now:  # the store holds the flag; the broadcast tells the workers (the job and the flag's time)
        broadcast_cancel(job_id, written)
    stopping = jobs.counts(job_id)["running"] if now else 0
    return {"job_id": job_id, "cancelled": cancelled, "stopping": stopping, "finished": False}


def cancel_request(request_id: str, *, reason: str = "cancelled") -> str:
    """Stop one row, whatever its job does: queued, it is cancelled now (``reason`` its error);
    running, its flag is written and broadcast, and its worker ends it at its next iteration,
    its partial text kept. What a caller that stopped reading a stream, or gave up waiting,
    does. Returns ``store.jobs.cancel_request``'s answer ("cancelled", "stopping", or the
    finished row's status)."""
    written = store.utcnow()
    what = jobs.cancel_request(request_id, at=written, reason=reason)
    if what == "stopping":  # the store holds the flag; the broadcast tells the workers at once
        broadcast_cancel(request_id, written)
    return what


def reclaim_and_enqueue(max_attempts: int = MAX_ATTEMPTS) -> list[dict[str, Any]]:
    """Requeue rows whose lease expired and send a message for each; returns them. (Every
    worker's lease step and a waiting ``run`` call it: whoever comes first.)"""
    rows = jobs.reclaim(get_settings().lease_timeout_s, max_attempts=max_attempts)
    by_pair: dict[str, list[str]] = {}
    for r in rows:
        if r["pair"]:
            by_pair.setdefault(r["pair"], []).append(r["id"])
    for pair, ids in by_pair.items():
        log.warning(
            "%d rows of pair %s lost their worker (no heartbeat for %g s): requeued",
            len(ids),
            pair,
            get_settings().lease_timeout_s,
        )
        enqueue(
            ids, pair, check_pair=False
        )  # a failure leaves them queued without a message: `run` and `retry` resend those
    return rows


def resend_unsent(pair: str) -> int:
    """Send again the rows of ``pair`` queued for longer than a lease timeout while its queue
    is empty: their messages were lost (a worker killed between the broker handing one out and
    its row being taken, a broker restarted without persistence), and a job fed by ``submit``
    has no ``run`` watching to resend them. Each row at most once per lease timeout, whoever
    asks (every idle worker's lease step: ``store.jobs.unsent`` gives each row to one). A
    duplicate is harmless: a row running or finished is left alone. Returns how many were sent."""
    if queue_size(pair) != 0:  # (None: the broker cannot say; leave it)
        return 0
    ids = jobs.unsent(pair, get_settings().lease_timeout_s)
    if ids:
        log.warning("%d rows of pair %s were queued with no message waiting: sent again", len(ids), pair)
        enqueue(ids, pair, check_pair=False)
    return len(ids)


def requeue_lost(job_id: str) -> int:
    """Enqueue again the job's rows that are still queued while their pair's queue is empty
    and none of the job's rows is running: their messages were lost (a broker restarted
    without persistence, or a worker killed between taking a message and its row). A duplicate
    message is harmless: a row already finished is a no-op. Returns how many were sent."""
    rows = job_requests(job_id, outputs=False)
    if any(r["status"] == "running" for r in rows):
        return 0
    by_pair: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] == "queued":
            by_pair.setdefault(r["pair"], []).append(r["id"])
    sent = 0
    for pair, ids in by_pair.items():
        if queue_size(pair) == 0:
            _enqueue_job(job_id, ids, pair)
            sent += len(ids)
    return sent


def wait_for_empty_queue(pair: str, *, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Until ``pair``'s queue holds no message, for at most ``timeout_s``; whether it emptied.
    A job is done when each row has finished once, but a resumed job may still have queued
    duplicates of finished rows (enqueued again because their messages could have been
    lost): a local worker about to stop takes them first, so none is left behind."""
    deadline = time.monotonic() + timeout_s
    while (queue_size(pair) or 0) > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


STORE_GRACE_S = 300  # s: how long `wait` keeps looking while the database cannot be read
# `wait` spends at most about 1/LOOK_SHARE of the database's time counting a job's rows: a
# 100,000-row job's count takes 0.03-0.2 s on PostgreSQL, so it is looked at every 0.6-4 s
# (at a fixed 0.3 s, a third of a database core went on it); a small job's every poll_s; and
# at least every LOOK_MAX_S (one slow count, a pause, does not blind `wait` for a minute)
LOOK_SHARE = 20
LOOK_MAX_S = 5.0


def next_look_s(poll_s: float, looked_s: float, deadline: float | None = None) -> float:
    """Seconds until ``wait``'s next look, its last one having taken ``looked_s`` (not past
    ``deadline``, a ``time.monotonic()``)."""
    pause = max(poll_s, min(LOOK_SHARE * looked_s, LOOK_MAX_S))
    return pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic()))


def wait(
    job_id: str,
    *,
    workers: list[LocalWorker] | None = None,
    on_progress: Callable[[dict[str, int]], object] | None = None,
    poll_s: float = 0.3,
    timeout_s: float | None = None,
    requeue_lost_after_s: float | None = None,
    restart: Callable[[LocalWorker], LocalWorker] | None = None,
    max_restarts: int = 20,
) -> dict[str, Any]:
    """Until no row of the job is queued or running; returns the counts by state.
    ``on_progress(counts)`` after each look. Raises RuntimeError when every local worker in
    ``workers`` has stopped first, TimeoutError after ``timeout_s``. A database that cannot
    be read (an outage, a lock) is looked at again for up to ``STORE_GRACE_S`` seconds.
    Every lease heartbeat period, rows whose worker is gone (lease expired) are requeued
    (as every worker does: whoever comes first). ``restart(proc)``: a new local worker for
    one in ``workers`` killed by a signal (at most ``max_restarts``; ``workers`` is a
    list, updated in place). ``requeue_lost_after_s``: when no row has finished for that
    long, none is running and some are queued, ``requeue_lost`` (rows whose message is
    gone, e.g. with a broker that lost its data, are sent again)."""
    workers = [] if workers is None else workers
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    last_read = progress_at = reclaimed_at = time.monotonic()
    last_done, restarts = -1, 0
    while True:
        look = time.monotonic()
        try:
            counts = job_counts(job_id)
            last_read, looked_s = time.monotonic(), time.monotonic() - look
        except store.TRANSIENT_ERRORS as e:  # the database is away (or locked) for a moment: look again
            if time.monotonic() - last_read > STORE_GRACE_S:
                raise
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not finished after {timeout_s} s (the database: {e})") from e
            time.sleep(min(2.0, 5 * poll_s))
            continue
        if on_progress:
            on_progress(counts)
        if not any(counts[s] for s in PENDING):
            return counts
        done = sum(counts[s] for s in FINISHED)
        if done != last_done:
            last_done, progress_at = done, time.monotonic()
        elif (
            requeue_lost_after_s is not None
            and counts["queued"]
            and not counts["running"]
            and time.monotonic() - progress_at > requeue_lost_after_s
        ):
            progress_at = time.monotonic()
            _requeue_lost_quietly(job_id)
        if counts["running"] and time.monotonic() - reclaimed_at > get_settings().lease_heartbeat_s:
            reclaimed_at = time.monotonic()
            _reclaim_quietly()
        restarts = _restart_killed(workers, restart, restarts, max_restarts)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} not finished after {timeout_s} s: {counts}")
        time.sleep(next_look_s(poll_s, looked_s, deadline))


def _reclaim_quietly() -> None:
    """Requeue the rows whose worker's lease expired (as every worker does: whoever comes first)."""
    try:
        reclaim_and_enqueue()
    except Exception as e:  # noqa: BLE001 - the database or broker is away: a worker or the next look does it
        log.debug("requeueing lost rows: %s", e)


def _requeue_lost_quietly(job_id: str) -> None:
    """``requeue_lost``, logged when it sent something; a store or broker away: not now."""
    try:
        n = requeue_lost(job_id)
    except store.TRANSIENT_ERRORS + (QueueError,):  # not now; look again later
        return
    if n:
        log.warning("job %s: %d queued rows had no message (lost with the broker); enqueued again", job_id, n)


def _restart_killed(
    workers: list[LocalWorker], restart: Callable[[LocalWorker], LocalWorker] | None, restarts: int, max_restarts: int
) -> int:
    """A new local worker (``restart(proc)``) for each in ``workers`` killed by a signal, while
    ``restarts`` < ``max_restarts``; raises RuntimeError when every one has stopped. Returns
    the restarts so far."""
    for i, p in enumerate(workers):
        code = p.poll()  # (once: a worker found alive here and dead below would be neither restarted nor waited for)
        if code is not None and code < 0 and restart is not None and restarts < max_restarts:
            restarts += 1
            log.warning("the local worker was killed (signal %d); starting another", -code)
            workers[i] = restart(p)
    if workers and all(p.returncode is not None for p in workers):
        p = workers[0]
        raise RuntimeError(f"the local worker stopped (exit code {p.returncode}); its log {p.log_path}:\n{log_tail(p)}")
    return restarts
