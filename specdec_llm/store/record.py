"""Writing to the store: plain dicts in, plain dicts/ids out.

Every write is idempotent: pairs upsert on name, workers on (host, pid, device name),
baselines on (pair, device kind, dtype), requests on their id or idempotency key, and
a result on its request id (the first result recorded wins; later ones are ignored).
Each call upgrades an empty or older database first (``sql.writing``).

The other writers of the store (``jobs``, ``admin``) share the steps that take a session:
``worker_row_id`` (a worker's row), ``worker_key``, ``output_insert`` (a row's output),
``row_changed`` (after one row of a job changed) and ``refresh_job`` (recount a job).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from importlib import metadata
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, Exists, and_, case, func, or_, select, update
from sqlalchemy.orm import Session

from .db import StoreError, check_schema, session_scope
from .models import (
    BASELINE_SOURCES,
    PENDING,
    STATS_FIELDS,
    Baseline,
    Job,
    Output,
    Pair,
    Request,
    Telemetry,
    Worker,
    utcnow,
)
from .sql import chunks, db_now, dialect_insert, writing

if TYPE_CHECKING:
    from sqlalchemy.dialects.postgresql import Insert as PostgresInsert
    from sqlalchemy.dialects.sqlite import Insert as SqliteInsert


def device_kind(device: str) -> str:
    """ "cuda:1" -> "cuda". Prices and baselines are per device kind."""
    return (device or "unknown").split(":", 1)[0].strip().lower() or "unknown"


def worker_info(device_name: str) -> dict[str, Any]:
    """This process as a worker dict for ``upsert_worker``/``record_result``."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device_name": device_name,
        "torch_version": version("torch"),
        "transformers_version": version("transformers"),
    }


# --- pairs, workers, baselines --------------------------------------------------------


def _pair_id(session: Session, name: str, **values: Any) -> int:
    now = utcnow()
    stmt = dialect_insert(session, Pair).values(name=name, created_at=now, updated_at=now, **values)
    if values:
        stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={**values, "updated_at": now})
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=["name"])
    session.execute(stmt)
    return session.execute(select(Pair.id).where(Pair.name == name)).scalar_one()


def upsert_pair(
    name: str,
    *,
    target: str | None = None,
    draft: str | None = None,
    target_fingerprint: str | None = None,
    draft_fingerprint: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    url: str | None = None,
) -> int:
    """Create or update the pair ``name``; returns its id."""
    values = dict(
        target=target,
        draft=draft,
        target_fingerprint=target_fingerprint,
        draft_fingerprint=draft_fingerprint,
        dtype=dtype,
        device=device,
    )
    with writing(url) as s:
        return _pair_id(s, name, **{k: v for k, v in values.items() if v is not None})


def worker_key(worker: dict[str, Any]) -> dict[str, Any]:
    """The columns that identify a worker process's row (``worker_info``'s dict)."""
    return {
        "host": str(worker.get("host") or "unknown"),
        "pid": int(worker.get("pid") or 0),
        "device_name": str(worker.get("device_name") or "unknown"),
    }


def output_insert(
    session: Session, request_id: str, result: dict[str, Any], finish_reason: str, output_tokens: int, now: datetime
) -> PostgresInsert | SqliteInsert:
    """The INSERT of a row's output (its text and token ids), a no-op where it has one."""
    stats = result.get("stats") or {}
    return (
        dialect_insert(session, Output)
        .values(
            request_id=request_id,
            text=_text(result.get("text")) or "",
            token_ids=list(result.get("token_ids") or []),
            prompt_tokens=int(stats.get("prompt_tokens") or 0),
            output_tokens=output_tokens,
            finish_reason=finish_reason,
            created_at=now,
        )
        .on_conflict_do_nothing(index_elements=["request_id"])
    )


def worker_row_id(session: Session, worker: dict[str, Any], *, now: datetime | None = None) -> int:
    """The id of ``worker``'s row (``worker_info``'s dict), created or refreshed (its
    versions, ``last_seen_at``: ``now``, default the database's ``db_now``) in ``session``'s
    transaction."""
    key = worker_key(worker)
    versions = {k: worker.get(k) for k in ("torch_version", "transformers_version")}
    now = now or db_now(session)
    stmt = dialect_insert(session, Worker).values(**key, **versions, started_at=now, last_seen_at=now)
    stmt = stmt.on_conflict_do_update(index_elements=list(key), set_={**versions, "last_seen_at": now})
    session.execute(stmt)
    return session.execute(select(Worker.id).filter_by(**key)).scalar_one()


def upsert_worker(worker: dict[str, Any], *, url: str | None = None) -> int:
    """Create or refresh a worker (keys: host, pid, device_name, torch_version,
    transformers_version; see ``worker_info``); returns its id."""
    with writing(url) as s:
        return worker_row_id(s, worker)


def record_baseline(
    pair: str,
    *,
    device: str,
    dtype: str,
    tokens_per_s: float,
    source: str = "calibration",
    samples: int = 1,
    url: str | None = None,
) -> dict[str, Any]:
    """Store the target-only speed of ``pair`` on ``device``'s kind in ``dtype``.

    ``source="calibration"`` replaces what was there. ``source="shadow"`` (one or a few
    target-only requests run beside real traffic) folds into an earlier shadow figure as
    a sample-weighted mean, and replaces a calibration one. Returns the stored baseline.
    """
    if source not in BASELINE_SOURCES:
        raise ValueError(f"source must be one of {BASELINE_SOURCES}, not {source!r}")
    if not tokens_per_s > 0 or samples < 1:
        raise ValueError("tokens_per_s must be > 0 and samples >= 1")
    with writing(url) as s:
        pair_id = _pair_id(s, pair)
        values = dict(pair_id=pair_id, device_kind=device_kind(device), dtype=dtype)
        stmt = dialect_insert(s, Baseline).values(
            **values, tokens_per_s=tokens_per_s, samples=samples, source=source, measured_at=utcnow()
        )
        ex = stmt.excluded
        new_tps: ColumnElement[Any]
        new_samples: ColumnElement[Any]
        if source == "shadow":
            # in SQL, so concurrent shadow samples don't race
            merge = Baseline.source == "shadow"
            new_tps = case(
                (
                    merge,
                    (Baseline.tokens_per_s * Baseline.samples + ex.tokens_per_s * ex.samples)
                    / (Baseline.samples + ex.samples),
                ),
                else_=ex.tokens_per_s,
            )
            new_samples = case((merge, Baseline.samples + ex.samples), else_=ex.samples)
        else:
            new_tps, new_samples = ex.tokens_per_s, ex.samples
        stmt = stmt.on_conflict_do_update(
            index_elements=list(values),
            set_={"tokens_per_s": new_tps, "samples": new_samples, "source": ex.source, "measured_at": ex.measured_at},
        )
        s.execute(stmt)
        row = s.execute(select(Baseline).filter_by(**values)).scalar_one()
        return {
            "pair": pair,
            "device_kind": row.device_kind,
            "dtype": row.dtype,
            "tokens_per_s": row.tokens_per_s,
            "samples": row.samples,
            "source": row.source,
            "measured_at": row.measured_at,
        }


# --- jobs and requests ----------------------------------------------------------------


def _status_counts(session: Session, job_id: str) -> dict[str, int]:
    """``job_id``'s rows by status: one count over its rows (by index)."""
    rows = session.execute(
        select(Request.status, func.count()).where(Request.job_id == job_id).group_by(Request.status)
    ).all()
    return {str(status): int(n) for status, n in rows}


def _job_state(counts: dict[str, int], *, started: bool) -> tuple[int, str]:
    """A job's rows by status -> (rows, job status: queued, running or done: nothing queued or
    running, a job left with no rows included). ``started``: a
    row of the job left the queue to run (as a running or ok row did; a row refused at submit,
    or cancelled before it ran, did not)."""
    total = sum(counts.values())
    pending = counts.get("queued", 0) + counts.get("running", 0)
    started = started or bool(counts.get("running") or counts.get("ok"))
    return total, "done" if not pending else ("running" if started else "queued")


def refresh_job(session: Session, job_id: str) -> None:
    """Recount ``job_id``'s rows by state into its counters and status (queued, running,
    done; started/finished times), in ``session``'s transaction: one count over the job's
    rows, for job-wide changes (a row-by-row change calls ``row_changed``)."""
    counts = _status_counts(session, job_id)
    first = session.scalar(select(func.min(Request.started_at)).where(Request.job_id == job_id))
    started = first is not None or bool(counts.get("running") or counts.get("ok"))
    total, status = _job_state(counts, started=started)
    now = utcnow()
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            n_requests=total,
            n_ok=counts.get("ok", 0),
            n_failed=counts.get("failed", 0),
            status=status,
            started_at=func.coalesce(Job.started_at, first, now) if started else Job.started_at,
            finished_at=func.coalesce(Job.finished_at, now) if status == "done" else None,
        )
    )


def pending_rows(job_id: str) -> Exists:
    """Whether ``job_id`` has a row queued or running (a condition for a statement on its job)."""
    return select(Request.id).where(Request.job_id == job_id, Request.status.in_(PENDING)).exists()


def row_changed(session: Session, job_id: str, *, started: bool = True) -> None:
    """After one row of a job changed: index lookups only, no count over the job's rows
    (one count per finished row made a 100k-row job quadratic). The job's counters are
    recounted when its last pending row finishes (``get_job`` counts them when asked);
    meanwhile it is marked running. ``started``: the row left the queue (running or finished).
    The job's row is locked first (PostgreSQL's FOR NO KEY UPDATE, which the foreign-key
    checks of a row's telemetry do not block; SQLite has one writer): of rows finishing at
    once, each sees the others' changes in turn, so the last one finishes the job."""
    session.execute(select(Job.id).where(Job.id == job_id).with_for_update(key_share=True))
    if not session.scalar(select(pending_rows(job_id))):
        refresh_job(session, job_id)
    elif started:
        now = utcnow()
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status != "running")
            .values(status="running", started_at=func.coalesce(Job.started_at, now), finished_at=None)
        )


class JobBeingPruned(StoreError):
    """A job ``prune`` has claimed (``jobs.pruning_at``) takes no new rows and no retry."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"job {job_id} is being deleted by `specdec-llm prune`; it takes no new rows and no retry: "
            "submit its input again once the prune has finished (a new job, the same id)"
        )


def refuse_pruned(session: Session, job_id: str) -> None:
    """``JobBeingPruned`` if ``prune`` has claimed ``job_id``; else its row is locked for this
    transaction (PostgreSQL's FOR NO KEY UPDATE, as prune's claim takes; the foreign-key checks
    of rows being written are not blocked), so no prune claims it before this transaction's
    rows count."""
    claimed = session.scalar(select(Job.pruning_at).where(Job.id == job_id).with_for_update(key_share=True))
    if claimed is not None:
        raise JobBeingPruned(job_id)


def _ensure_job(
    session: Session, job_id: str, *, hold_s: float | None = None, refuse: bool = True, **values: Any
) -> None:
    """The job's row, created if missing; ``hold_s``: held for that long from now (``hold_job``),
    in this transaction: no ``prune`` deletes it between its submission and its hold. A job
    ``prune`` has claimed is refused (``JobBeingPruned``) unless not ``refuse`` (a result of a
    row it has: recorded, or found recorded, as any other)."""
    stmt = dialect_insert(session, Job).values(id=job_id, created_at=utcnow(), status="queued", **values)
    session.execute(stmt.on_conflict_do_nothing(index_elements=["id"]))
    if refuse:
        refuse_pruned(session, job_id)
    if hold_s is None:
        return
    until = db_now(session) + timedelta(seconds=hold_s)  # (prune compares it with the database's clock)
    held = session.execute(update(Job).where(Job.id == job_id).values(held_until=until).returning(Job.id)).first()
    if held is None:  # a prune deleted it after the insert found it (PostgreSQL): create it again
        _ensure_job(session, job_id, hold_s=hold_s, **values)


def hold_job(job_id: str, hold_s: float, *, url: str | None = None) -> bool:
    """Hold ``job_id`` for ``hold_s`` seconds from now: ``prune`` leaves a held job alone. A
    command still using a job (``run``: until its results file is written) holds it, renewing
    the hold before it ends, and lets go with ``release_job``; one killed outright lets go when
    its hold ends. False when there is no such job."""
    with writing(url) as s:
        until = db_now(s) + timedelta(seconds=hold_s)  # (prune compares it with the database's clock)
        held = s.execute(update(Job).where(Job.id == job_id).values(held_until=until).returning(Job.id)).first()
        return held is not None


def release_job(job_id: str, *, url: str | None = None) -> None:
    """End ``job_id``'s hold (``hold_job``): ``prune`` may delete it from now on, once finished."""
    with writing(url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(held_until=None))


def create_job(
    requests: Iterable[dict[str, Any] | str],
    *,
    name: str | None = None,
    pair: str | None = None,
    params: dict[str, Any] | None = None,
    job_id: str | None = None,
    hold_s: float | None = None,
    url: str | None = None,
) -> dict[str, Any]:
    """Create a job and one row per request, idempotently.

    Each request is a prompt string or a dict with ``prompt`` (text) or ``messages``
    (chat turns), and optionally ``params`` (dict), ``idempotency_key``, ``category``
    (a label the reports can group by) and ``id``. A request whose idempotency key (or
    id) already exists is not created again; its existing id is returned in its place.
    Calling again with the same ``job_id`` adds only what is missing. ``hold_s``: the job is
    also held that long (``hold_job``), in the same transaction.

    Returns ``{"job_id", "request_ids" (input order), "created" (new rows)}``.
    """
    job_id = job_id or str(uuid.uuid4())
    rows = _request_rows(requests)
    with writing(url) as s:
        pair_id = _pair_id(s, pair) if pair else None
        _ensure_job(s, job_id, hold_s=hold_s, name=name, pair_id=pair_id, params=params)
        now = db_now(s)  # (a lease's last resort, and what `unsent` and `reclaim` compare: the database's clock)
        for r in rows:
            r.update(job_id=job_id, pair_id=pair_id, status="queued", attempts=0, created_at=now)
        # which keys and ids exist already (then the insert skips them, and any
        # row a concurrent caller slipped in meanwhile)
        keys = [r["idempotency_key"] for r in rows if r["idempotency_key"]]
        by_key = _ids_by_key(s, keys)
        known_ids: set[str] = set()
        for chunk in chunks([r["id"] for r in rows]):
            known_ids.update(s.scalars(select(Request.id).where(Request.id.in_(chunk))))
        new = [r for r in rows if r["idempotency_key"] not in by_key and r["id"] not in known_ids]
        if new:
            # a `cancel --now` that has ended (no row left to run) does not stop rows added since (a
            # LangChain job_name's later calls); one still stopping its rows stops these too
            ended = update(Job).where(Job.id == job_id, ~pending_rows(job_id))
            s.execute(ended.values(cancel_requested_at=None, cancelled_at=None))
            s.execute(dialect_insert(s, Request).on_conflict_do_nothing(), new)
        by_key = _ids_by_key(s, keys)  # again: a concurrent caller may have won a key
        refresh_job(s, job_id)
    request_ids = [by_key.get(r["idempotency_key"], r["id"]) if r["idempotency_key"] else r["id"] for r in rows]
    return {"job_id": job_id, "request_ids": request_ids, "created": len(new)}


def _request_rows(requests: Iterable[dict[str, Any] | str]) -> list[dict[str, Any]]:
    """``create_job``'s requests as rows of the requests table (their job's columns to come)."""
    rows = []
    for item in requests:
        item = {"prompt": item} if isinstance(item, str) else dict(item)
        if item.get("prompt") is None and item.get("messages") is None:
            raise ValueError("each request needs a 'prompt' or 'messages'")
        rows.append(
            {
                "id": str(item.get("id") or uuid.uuid4()),
                "idempotency_key": item.get("idempotency_key"),
                "category": item.get("category"),
                "prompt": _text(item.get("prompt")),
                "messages": item.get("messages"),
                "params": item.get("params"),
            }
        )
    return rows


def _ids_by_key(s: Session, keys: list[str]) -> dict[str | None, str]:
    """The ids of the stored requests with these idempotency keys, by key."""
    by_key: dict[str | None, str] = {}
    for chunk in chunks(keys):
        by_key.update(
            s.execute(select(Request.idempotency_key, Request.id).where(Request.idempotency_key.in_(chunk))).all()
        )
    return by_key


def _text(value: str | None) -> str | None:
    """PostgreSQL text cannot hold NUL (tiny random models emit it): store U+FFFD instead."""
    return None if value is None else value.replace("\x00", "\ufffd")


def mark_request(
    request_id: str,
    status: str,
    *,
    error: str | None = None,
    worker: dict[str, Any] | None = None,
    held_by: str | None = None,
    url: str | None = None,
) -> bool:
    """Move a request to ``status`` ("queued", "running", "failed" or "cancelled").

    "running" counts an attempt (``attempts += 1``) and stamps ``started_at``;
    "failed"/"cancelled" stamp ``finished_at``; ``error`` is stored as given (None clears
    it). A request already recorded as "ok" is never changed (a late duplicate delivery
    can't undo a result), and only a queued or running request starts "running" (a
    cancelled one stays cancelled). ``held_by``: only the row that lease owner runs, or a
    queued one never taken (a worker failing the row it had: not one cancelled, finished,
    requeued or run by another worker meanwhile). Returns whether a row changed. Results go
    through ``record_result``.
    """
    if status not in ("queued", "running", "failed", "cancelled"):
        raise ValueError(f"status must be queued, running, failed or cancelled, not {status!r}")
    with writing(url) as s:
        now = db_now(s)  # (started_at: a lease's; one clock for a row's times)
        values: dict[str, Any] = {"status": status, "error": error}
        if status == "running":
            values.update(attempts=Request.attempts + 1, started_at=func.coalesce(Request.started_at, now))
        if status in ("failed", "cancelled"):
            values["finished_at"] = now
        if status != "running":
            values.update(lease_owner=None, heartbeat_at=None)
        if worker:
            values["worker_id"] = worker_row_id(s, worker, now=now)
        # "ok" is final; a row only starts running from queued/running (never over a cancel)
        allowed = Request.status.in_(PENDING) if status == "running" else Request.status != "ok"
        if held_by is not None:
            mine = and_(Request.status == "running", Request.lease_owner == held_by)
            never_taken = and_(Request.status == "queued", Request.attempts == 0)  # (failed before its take)
            allowed = or_(mine, never_taken)
        changed = s.execute(
            update(Request)
            .where(Request.id == request_id, allowed)
            .values(**values)
            .returning(Request.job_id, Request.started_at)
        ).first()
        if changed is not None and changed.job_id:  # (a row that never ran, refused at submit: not a start)
            row_changed(s, changed.job_id, started=status != "queued" and changed.started_at is not None)
        return changed is not None


# --- results ----------------------------------------------------------------------------


def record_result(
    request_id: str,
    result: dict[str, Any],
    *,
    worker: dict[str, Any] | None,
    device: str,
    queue_wait_s: float | None,
    pair: str,
    job_id: str | None,
    price_per_hour: float | None,
    dtype: str | None = None,
    category: str | None = None,
    finished_at: datetime | None = None,
    url: str | None = None,
) -> bool:
    """Store a ``GenerationResult.to_dict()`` for ``request_id``: output, telemetry, status.

    Idempotent: if the request already has a result, nothing is written and False is
    returned (read the stored one with ``get_request``); True when this call wrote it.
    A request row that was never created (direct engine use) is created here.
    ``dtype`` defaults to the pair's; ``price_per_hour`` (USD per device-hour) gives
    the row's estimated cost = wall time x price; ``finished_at`` (naive UTC) defaults
    to now.
    """
    stats = {k: v for k, v in (result.get("stats") or {}).items() if k in STATS_FIELDS}
    finish_reason = result.get("finish_reason") or stats.get("finish_reason") or "length"
    stats["finish_reason"] = finish_reason
    with writing(url) as s:
        now = finished_at or utcnow()
        pair_id = _pair_id(s, pair)
        worker_id = worker_row_id(s, worker) if worker else None
        req = _request_row(s, request_id, job_id=job_id, pair_id=pair_id, category=category, now=now)
        output = output_insert(s, request_id, result, finish_reason, int(stats.get("output_tokens") or 0), now)
        if s.execute(output.returning(Output.request_id)).first() is None:
            return False  # recorded already: the first result wins
        telemetry = dict(
            job_id=req.job_id,
            worker_id=worker_id,
            category=req.category or category,
            device=device,
            dtype=dtype or s.scalar(select(Pair.dtype).where(Pair.id == pair_id)),
            finished_at=now,
            queue_wait_s=queue_wait_s,
            price_per_hour=price_per_hour,
        )
        s.execute(_telemetry_insert(s, request_id, pair_id, stats, **telemetry))
        _mark_ok(s, request_id, worker_id=worker_id, pair_id=pair_id, now=now)
        if req.job_id:
            row_changed(s, req.job_id)
        return True


def _request_row(
    session: Session, request_id: str, *, job_id: str | None, pair_id: int, category: str | None, now: datetime
) -> Any:
    """The request's ``(job_id, category)``; a row never created (direct engine use) is
    created here, running, with its job."""
    if job_id:
        _ensure_job(session, job_id, pair_id=pair_id, refuse=False)
    session.execute(
        dialect_insert(session, Request)
        .values(
            id=request_id,
            job_id=job_id,
            pair_id=pair_id,
            category=category,
            status="running",
            attempts=1,
            created_at=now,
            started_at=now,
        )
        .on_conflict_do_nothing(index_elements=["id"])
    )
    return session.execute(select(Request.job_id, Request.category).where(Request.id == request_id)).one()


def _telemetry_insert(
    session: Session,
    request_id: str,
    pair_id: int,
    stats: dict[str, Any],
    *,
    device: str,
    price_per_hour: float | None,
    **values: Any,
) -> PostgresInsert | SqliteInsert:
    """The INSERT of a finished row's telemetry (its ``Stats`` fields, where and how it ran,
    its estimated cost = its share of the device's time (wall time / the rows it was decoded
    beside) x ``price_per_hour``), a no-op where it has some."""
    wall = float(stats.get("wall_time_s") or 0.0) / (float(stats.get("batch_rows") or 0.0) or 1.0)
    return (
        dialect_insert(session, Telemetry)
        .values(
            request_id=request_id,
            pair_id=pair_id,
            device=device,
            device_kind=device_kind(device),
            price_per_hour=price_per_hour,
            estimated_cost_usd=None if price_per_hour is None else wall / 3600.0 * price_per_hour,
            **values,
            **stats,
        )
        .on_conflict_do_nothing(index_elements=["request_id"])
    )


def _mark_ok(session: Session, request_id: str, *, worker_id: int | None, pair_id: int, now: datetime) -> None:
    """The request is done: status ok, its lease released, its worker and pair set."""
    session.execute(
        update(Request)
        .where(Request.id == request_id)
        .values(
            status="ok",
            error=None,
            finished_at=now,
            lease_owner=None,
            heartbeat_at=None,
            worker_id=worker_id if worker_id is not None else Request.worker_id,
            pair_id=func.coalesce(Request.pair_id, pair_id),
        )
    )


# --- reading single rows -------------------------------------------------------------


def get_request(request_id: str, *, url: str | None = None) -> dict[str, Any] | None:
    """A request's status, error, attempts and (when done) output, as a dict; None if unknown."""
    with writing(url) as s:
        row = s.execute(
            select(Request, Output).outerjoin(Output, Output.request_id == Request.id).where(Request.id == request_id)
        ).first()
        if row is None:
            return None
        req, out = row
        return {
            "id": req.id,
            "job_id": req.job_id,
            "status": req.status,
            "error": req.error,
            "attempts": req.attempts,
            "category": req.category,
            "prompt": req.prompt,
            "lease_owner": req.lease_owner,
            "heartbeat_at": req.heartbeat_at,
            "requeues": req.requeues,
            "messages": req.messages,
            "params": req.params,
            "created_at": req.created_at,
            "started_at": req.started_at,
            "finished_at": req.finished_at,
            "output": None
            if out is None
            else {
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "prompt_tokens": out.prompt_tokens,
                "output_tokens": out.output_tokens,
            },
        }


def get_stats(request_id: str, *, url: str | None = None) -> dict[str, Any]:
    """A finished request's telemetry as the engine's ``Stats`` fields (a dict; empty when
    it has none)."""
    with writing(url) as s:
        tel = s.get(Telemetry, request_id)
        return {} if tel is None else {f: getattr(tel, f) for f in STATS_FIELDS}


def get_job(job_id: str, *, url: str | None = None) -> dict[str, Any] | None:
    """A job's status and counts (counted from its rows now), as a dict; None if unknown.
    Reads only: a read-only store serves it."""
    check_schema(url)
    with session_scope(url) as s:
        job = s.get(Job, job_id)
        if job is None:
            return None
        counts = _status_counts(s, job_id)
    total, status = _job_state(counts, started=job.started_at is not None)
    return {
        "id": job.id,
        "name": job.name,
        "status": status,
        "n_requests": total,
        "n_ok": counts.get("ok", 0),
        "n_failed": counts.get("failed", 0),
        "params": job.params,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at if status == "done" else None,
        "held_until": job.held_until,
    }
