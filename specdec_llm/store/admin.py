"""Operating the store: list jobs and workers, record worker heartbeats, prune old jobs.

Plain dicts out, naive UTC times, as everywhere in the store.

- ``list_jobs``: newest first (index ``ix_jobs_created`` / ``ix_jobs_status_created``), each
  job with its rows by state and its tokens/s so far, counted from the listed jobs' rows
  only (never a scan of every job's rows).
- ``heartbeat_worker`` / ``list_workers``: a worker process writes what it serves and how it
  is doing every ``SPECDEC_LEASE_HEARTBEAT_S``; a worker whose heartbeat is older than
  ``stale_after_s`` (the lease timeout) is marked stale: it stopped, or cannot reach the store.
- ``prune_plan`` / ``prune``: finished jobs created before a cutoff and held by no command
  (``record.hold_job``: ``run`` holds its job until its results file is written), deleted with their rows,
  outputs and telemetry in transactions of at most ``PRUNE_BATCH`` rows each, then the emptied
  jobs ``_JOBS_PER_DELETE`` at a time, so workers and readers keep using the store (SQLite has
  one writer at a time) while it runs: 1,000,000 telemetry rows, half of them pruned, in
  transactions of at most ~1 s (``benchmarks/bench_prune.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, func, inspect, or_, select, update
from sqlalchemy.orm import Session

from .db import StoreError, check_schema, get_engine, session_scope
from .models import JOB_STATUSES, Base, Job, Output, Pair, Request, Telemetry, Worker, utcnow
from .record import worker_key
from .sql import chunks, db_now, dialect_insert, writing

PRUNE_BATCH = 5000  # request rows deleted per transaction
_JOBS_PER_LOOK = 500  # prunable jobs looked at per transaction
_JOBS_PER_DELETE = 10  # emptied jobs deleted per transaction (PostgreSQL scans telemetry for each)


class AdminInputError(StoreError, ValueError):
    """Bad input to a listing (a state no job has); the message names the option and the fix."""


# -- jobs ------------------------------------------------------------------------------------
def list_jobs(
    *,
    state: str | None = None,
    name: str | None = None,
    since: datetime | None = None,
    limit: int = 20,
    url: str | None = None,
) -> list[dict[str, Any]]:
    """Jobs newest first: ``state`` (queued, running, done), ``name`` (jobs whose name
    contains it, in any case), ``since`` (created at or after), at most ``limit``. Each: id, name, pair,
    state, created/started/finished times, ``cancel_requested`` (``cancel --now``), rows by
    state (``rows``, ``ok``, ``failed``, ``cancelled``, ``pending``), ``output_tokens`` of
    its ok rows and ``tokens_per_s`` over the job's elapsed time (as ``status`` says)."""
    if state is not None and state not in JOB_STATUSES:
        raise AdminInputError(f"state: {state!r} unknown; use --state {', --state '.join(JOB_STATUSES)}")
    check_schema(url)
    q = select(
        Job.id,
        Job.name,
        Pair.name.label("pair"),
        Job.status.label("state"),
        Job.created_at,
        Job.started_at,
        Job.finished_at,
        Job.cancel_requested_at,
    ).outerjoin(Pair, Pair.id == Job.pair_id)
    if state is not None:
        q = q.where(Job.status == state)
    if name:
        q = q.where(Job.name.icontains(name, autoescape=True))
    if since is not None:
        q = q.where(Job.created_at >= since)
    q = q.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
    with session_scope(url) as s:
        jobs = [dict(r) for r in s.execute(q).mappings()]
        counts = _row_counts(s, [j["id"] for j in jobs])
    now = utcnow()
    for j in jobs:
        c = counts.get(j["id"], {})
        by = {k: c.get(k, (0, 0))[0] for k in ("queued", "running", "ok", "failed", "cancelled")}
        elapsed = ((j["finished_at"] or now) - j["started_at"]).total_seconds() if j["started_at"] else 0.0
        tokens = c.get("ok", (0, 0))[1]
        j.update(
            cancel_requested=j.pop("cancel_requested_at") is not None,
            rows=sum(by.values()),
            ok=by["ok"],
            failed=by["failed"],
            cancelled=by["cancelled"],
            pending=by["queued"] + by["running"],
            output_tokens=tokens,
            tokens_per_s=tokens / elapsed if elapsed > 0 and tokens else None,
            age_s=(now - j["created_at"]).total_seconds(),
        )
    return jobs


def _row_counts(session: Session, job_ids: list[str]) -> dict[str, dict[str, tuple[int, int]]]:
    """job id -> status -> (rows, output tokens): the listed jobs' rows only (by index)."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for chunk in chunks(job_ids):
        q = (
            select(Request.job_id, Request.status, func.count(), func.sum(Output.output_tokens))
            .outerjoin(Output, Output.request_id == Request.id)
            .where(Request.job_id.in_(chunk))
            .group_by(Request.job_id, Request.status)
        )
        for job_id, status, n, tokens in session.execute(q):
            out.setdefault(str(job_id), {})[status] = (int(n), int(tokens or 0))
    return out


# -- workers ---------------------------------------------------------------------------------
def heartbeat_worker(
    worker: dict[str, Any],
    *,
    pair: str,
    dtype: str | None,
    max_batch: int | None,
    rows_done: int,
    output_tokens: int,
    tokens_per_s: float | None,
    url: str | None = None,
) -> None:
    """A worker process is alive now (``worker``: ``record.worker_info``'s dict), serving
    ``pair`` in ``dtype`` with batches of up to ``max_batch``, with ``rows_done`` rows and
    ``output_tokens`` tokens recorded since it started and ``tokens_per_s`` lately."""
    key = worker_key(worker)
    with writing(url) as s:
        now = db_now(s)  # (list_workers tells stale ones by the database's clock)
        beat = dict(
            pair=pair,
            dtype=dtype,
            max_batch=max_batch,
            rows_done=rows_done,
            output_tokens=output_tokens,
            tokens_per_s=tokens_per_s,
            heartbeat_at=now,
            last_seen_at=now,
            torch_version=worker.get("torch_version"),
            transformers_version=worker.get("transformers_version"),
        )
        stmt = dialect_insert(s, Worker).values(**key, **beat, started_at=now)
        s.execute(stmt.on_conflict_do_update(index_elements=list(key), set_=beat))


def worker_stopped(worker: dict[str, Any], *, rows_done: int, output_tokens: int, url: str | None = None) -> None:
    """A worker process that beat (``heartbeat_worker``) stops cleanly: its last counts, seen
    now, and no heartbeat any more, so ``list_workers`` shows it stopped (not live, and
    never stale)."""
    with writing(url) as s:
        s.execute(
            update(Worker)
            .filter_by(**worker_key(worker))
            .values(
                rows_done=rows_done,
                output_tokens=output_tokens,
                tokens_per_s=None,
                heartbeat_at=None,
                last_seen_at=db_now(s),
            )
        )


def list_workers(
    *, stale_after_s: float, since: datetime | None = None, url: str | None = None
) -> list[dict[str, Any]]:
    """Workers with a heartbeat, or stopped cleanly after beating (``worker_stopped``: its
    pair is known, its heartbeat cleared), last seen at or after ``since``, latest first.
    Each: host, pid, pair, device, dtype, max_batch, rows_done, output_tokens, tokens_per_s,
    started_at, last_seen (its latest heartbeat, or when it stopped), last_seen_s (seconds
    ago), ``stopped``, and ``stale`` (not stopped, no heartbeat for ``stale_after_s`` s)."""
    check_schema(url)
    W = Worker
    last_seen = func.coalesce(W.heartbeat_at, W.last_seen_at)
    q = select(
        W.host,
        W.pid,
        W.pair,
        W.device_name.label("device"),
        W.dtype,
        W.max_batch,
        W.rows_done,
        W.output_tokens,
        W.tokens_per_s,
        W.started_at,
        last_seen.label("last_seen"),
        W.heartbeat_at.is_(None).label("stopped"),
    ).where(or_(W.heartbeat_at.is_not(None), W.pair.is_not(None)))  # (only heartbeats write the pair)
    if since is not None:
        q = q.where(or_(W.heartbeat_at >= since, and_(W.heartbeat_at.is_(None), W.last_seen_at >= since)))
    with session_scope(url) as s:
        rows = [dict(r) for r in s.execute(q.order_by(last_seen.desc(), W.id.desc())).mappings()]
        now = db_now(s)  # (the heartbeats' clock: a reader whose own clock is off marks none stale wrongly)
    for r in rows:
        r["stopped"] = bool(r["stopped"])
        r["last_seen_s"] = max(0.0, (now - r["last_seen"]).total_seconds())
        r["stale"] = not r["stopped"] and r["last_seen_s"] > stale_after_s
    return rows


# -- prune -----------------------------------------------------------------------------------
def _last_active() -> ColumnElement[Any]:
    """When a job was last in use: its last finish (a job used again, a LangChain ``job_name``'s
    or a resumed ``run``'s, finishes again), else its creation."""
    return func.coalesce(Job.finished_at, Job.created_at)


def _prunable(cutoff: datetime, job_id: str | None, now: datetime) -> list[Any]:
    """Claimed by a prune already (``jobs.pruning_at``: one cut short, or this one's earlier
    transactions), or finished, last in use before ``cutoff`` and held by no command at ``now``
    (the database's clock, ``db_now``, as the holds': ``record.hold_job``: a ``run`` still
    exporting it); only ``job_id`` if given. Evaluated at each use: a hold written meanwhile
    counts (its end is after any ``now`` read before)."""
    unheld = or_(Job.held_until.is_(None), Job.held_until <= now)
    where = [or_(Job.pruning_at.is_not(None), and_(Job.status == "done", _last_active() < cutoff, unheld))]
    return [*where, Job.id == job_id] if job_id is not None else where


def prune_plan(cutoff: datetime, *, job_id: str | None = None, url: str | None = None) -> dict[str, int]:
    """What ``prune`` would delete: ``jobs`` (finished, last in use before ``cutoff``; only
    ``job_id`` if given) and their ``rows``; ``unfinished``: older jobs kept because rows are
    still queued or running; ``held``: older finished jobs kept because a command still uses
    them (``record.hold_job``). Reads only."""
    check_schema(url)
    with session_scope(url) as s:
        now = db_now(s)
        ids = s.scalars(select(Job.id).where(*_prunable(cutoff, job_id, now))).all()
        rows = 0
        for chunk in chunks(list(ids)):
            rows += s.scalar(select(func.count()).where(Request.job_id.in_(chunk))) or 0
        older = [_last_active() < cutoff] + ([Job.id == job_id] if job_id else [])
        unclaimed = [*older, Job.pruning_at.is_(None)]
        unfinished = s.scalar(select(func.count()).select_from(Job).where(*unclaimed, Job.status != "done")) or 0
        in_use = [*unclaimed, Job.status == "done", Job.held_until > now]
        held = s.scalar(select(func.count()).select_from(Job).where(*in_use))
    return {"jobs": len(ids), "rows": rows, "unfinished": unfinished, "held": held or 0}


def prune(
    cutoff: datetime,
    *,
    job_id: str | None = None,
    batch_rows: int | None = None,
    on_batch: Callable[[dict[str, int]], None] | None = None,
    url: str | None = None,
) -> dict[str, int]:
    """Delete finished jobs last in use before ``cutoff`` (only ``job_id`` if given) with their
    rows, outputs and telemetry: at most ``batch_rows`` rows per transaction (default
    ``PRUNE_BATCH``), a job once its rows are gone. Returns what it freed: ``{"jobs", "rows", "outputs", "telemetry"}``
    (``on_batch(freed so far)`` after each transaction). A job is claimed in the transaction
    that deletes its first rows (``jobs.pruning_at``) and is deleted whole from then on: a
    ``retry`` or new rows for it are refused meanwhile, and a prune cut short is finished by
    the next one."""
    batch_rows = PRUNE_BATCH if batch_rows is None else batch_rows
    if batch_rows < 1:
        raise ValueError("batch_rows: use at least 1")
    check_schema(url)
    freed = {"jobs": 0, "rows": 0, "outputs": 0, "telemetry": 0}
    while True:
        with session_scope(url) as s:
            where = _prunable(cutoff, job_id, db_now(s))
            jobs = list(s.scalars(select(Job.id).where(*where).order_by(Job.created_at, Job.id).limit(_JOBS_PER_LOOK)))
            if not jobs:
                return freed
            jobs = _claim(s, jobs, where)
            ids = list(s.scalars(select(Request.id).where(Request.job_id.in_(jobs)).limit(batch_rows)))
            for chunk in chunks(ids):
                freed["telemetry"] += _deleted(s, Telemetry, Telemetry.request_id.in_(chunk))
                freed["outputs"] += _deleted(s, Output, Output.request_id.in_(chunk))
                freed["rows"] += _deleted(s, Request, Request.id.in_(chunk))
        if not ids:  # these jobs hold no rows any more
            for group in chunks(jobs, _JOBS_PER_DELETE):
                freed["jobs"] += _delete_emptied_jobs(url, group, where)
                if on_batch is not None:
                    on_batch(dict(freed))
        elif on_batch is not None:
            on_batch(dict(freed))


def _claim(session: Session, job_ids: list[str], where: list[Any]) -> list[str]:
    """Of ``job_ids``, those still prunable (``where``: claimed, or finished with no hold) when
    this transaction writes, claimed (``pruning_at``) and locked until it ends: the first write
    of the transaction (SQLite: its write lock from here on; PostgreSQL: these rows' locks, and
    a row whose hold or retry was written meanwhile is read again and left out). A ``run``
    holding one of them, or a ``retry``, meanwhile waits for this transaction, or this
    transaction leaves its job alone; once it commits they refuse the job
    (``record.refuse_pruned``)."""
    claimed = session.execute(
        update(Job)
        .where(Job.id.in_(job_ids), *where)
        .values(held_until=None, pruning_at=func.coalesce(Job.pruning_at, utcnow()))
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    )
    return [str(job_id) for job_id in claimed.scalars()]


def _delete_emptied_jobs(url: str | None, job_ids: list[str], where: list[Any]) -> int:
    """Delete the jobs of ``job_ids`` still prunable (``where``) that hold no request rows, in
    one short transaction; how many went. Their rows, outputs and telemetry went first (a
    telemetry row's request is in the row's job, so a job without requests has none). On
    SQLite with the connection's foreign-key checks off: each deleted job would otherwise scan
    all of telemetry for rows citing it (``telemetry.job_id`` has no index of its own, on
    purpose: reports read the covering index), 80 s for 500 jobs beside 500,000 telemetry rows
    in one transaction that holds the only write lock. On PostgreSQL the scan stays (its
    cascade check; about 0.25 s a job there) but blocks no reader or other writer: hence a few
    jobs per transaction (``_JOBS_PER_DELETE``)."""
    empty = ~select(Request.id).where(Request.job_id == Job.id).exists()
    stmt = delete(Job).where(Job.id.in_(job_ids), *where, empty).returning(Job.id)
    engine = get_engine(url)
    with engine.connect() as conn:
        sqlite = engine.dialect.name == "sqlite"
        if sqlite:  # outside a transaction, or SQLite ignores it
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                return len(conn.execute(stmt).all())
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


def _deleted(session: Session, model: type[Base], *where: ColumnElement[bool]) -> int:
    """DELETE FROM ``model``'s table WHERE ...; how many rows went (RETURNING its primary
    key: one way on both databases)."""
    key = list(inspect(model).primary_key)
    stmt = delete(model).where(*where).returning(*key).execution_options(synchronize_session=False)
    return len(session.execute(stmt).all())
