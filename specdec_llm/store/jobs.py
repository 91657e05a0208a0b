"""Leases and job-wide operations: set-based SQL, one statement per change, never row by row.

A worker that takes a request row holds a *lease* on it: ``take`` writes the worker's
Celery node name (``lease_owner``) and a heartbeat (``heartbeat_at``); the worker renews
the heartbeat of every row it holds (``renew``) while they run. A running row whose
heartbeat is older than the lease timeout lost its worker (SIGKILL, out of memory, a lost
machine, tasks cancelled when the broker went away): ``reclaim`` moves it back to
"queued" in one atomic UPDATE ... RETURNING, so whoever runs it (every worker and `run`
do, periodically), each lost row is requeued exactly once; the caller then enqueues the
returned rows. A row that lost ``max_attempts`` workers fails instead. Every time a lease
writes or compares is the database's (``sql.db_now``), never the calling host's: workers on
hosts whose clocks disagree share one store.

Job-wide: ``counts`` (by state, plus lost and requeued rows), ``requeue`` (retry) and
``cancel``, each one UPDATE over the job's rows; ``job_requests``, every row of a job
(with its output and key telemetry) as plain dicts, in input order.

A task's first visit, ``start``, takes its row and reads it (with its job's cancel flag) in
one transaction; the lease heartbeat, ``renew_leases``, renews the held rows and reads their
jobs' cancel flags in one.

``cancel(job, now=True)`` also sets the job's cancel flag (``jobs.cancel_requested_at``):
workers, told by a broadcast (or finding it at ``start`` or ``renew_leases``), read it
(``cancel_times``, one query for every job they are running) and end
each running row at its next iteration as cancelled, its partial text kept
(``end_cancelled``: an output, no telemetry, so reports count finished rows only). A retry
clears the flag; ``retry --cancelled`` drops those partial outputs before the rows run again.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, and_, case, delete, func, or_, select, update
from sqlalchemy.orm import Session

from .db import check_schema, session_scope
from .models import PENDING, Job, Output, Pair, Request, Telemetry, utcnow
from .record import output_insert, pending_rows, refresh_job, refuse_pruned, row_changed, worker_row_id
from .sql import chunks, db_now, writing

FINISHED = ("ok", "failed", "cancelled")


def _beat() -> ColumnElement[datetime]:
    """A running row's last sign of life (rows taken before 0004 have no heartbeat)."""
    return func.coalesce(Request.heartbeat_at, Request.started_at, Request.created_at)


def _lost(cutoff: datetime) -> ColumnElement[bool]:
    return and_(Request.status == "running", _beat() < cutoff)


def take(
    request_id: str, owner: str, *, lease_timeout_s: float, worker: dict[str, Any] | None = None, url: str | None = None
) -> bool:
    """Start running ``request_id`` under a lease held by ``owner`` (a Celery node name):
    from "queued", or from "running" when the lease is ``owner``'s own or has expired
    (its worker is gone). Counts an attempt. False when the row is finished, cancelled, or
    running under another worker's live lease (a stale duplicate message: leave it)."""
    with writing(url) as s:
        return _take(s, request_id, owner, lease_timeout_s, None, worker)


def _take(
    s: Session,
    request_id: str,
    owner: str,
    lease_timeout_s: float,
    max_attempts: int | None,
    worker: dict[str, Any] | None,
) -> bool:
    """``take`` inside the caller's transaction (``start`` reads the row in the same one);
    ``max_attempts``: a row already tried that often is not taken from "running". Its times are
    the database's (``db_now``), as every lease's."""
    now = db_now(s)
    running = [Request.status == "running"]
    if max_attempts is not None:
        running.append(Request.attempts < max_attempts)
    takeable = or_(
        Request.status == "queued",
        and_(
            *running,
            or_(
                Request.lease_owner.is_(None),
                Request.lease_owner == owner,
                _beat() < now - timedelta(seconds=lease_timeout_s),
            ),
        ),
    )
    values: dict[str, Any] = dict(
        status="running",
        error=None,
        attempts=Request.attempts + 1,
        lease_owner=owner,
        heartbeat_at=now,
        started_at=func.coalesce(Request.started_at, now),
    )
    if worker:
        values["worker_id"] = worker_row_id(s, worker, now=now)
    taken = s.execute(
        update(Request).where(Request.id == request_id, takeable).values(**values).returning(Request.job_id)
    ).first()
    if taken is not None and taken.job_id:
        row_changed(s, taken.job_id)
    return taken is not None


def renew(request_ids: Iterable[str], owner: str, *, url: str | None = None) -> int:
    """Heartbeat: the rows in ``request_ids`` that ``owner`` still holds are alive now."""
    request_ids = list(request_ids)
    if not request_ids:
        return 0
    with writing(url) as s:
        return len(_beat_held(s, request_ids, owner))


def _beat_held(s: Session, request_ids: list[str], owner: str) -> list[Any]:
    """The heartbeat's update: ``owner``'s running rows among ``request_ids`` alive now; their
    ids, job ids and own cancel flags."""
    return list(
        s.execute(
            update(Request)
            .where(Request.id.in_(request_ids), Request.status == "running", Request.lease_owner == owner)
            .values(heartbeat_at=db_now(s))
            .returning(Request.id, Request.job_id, Request.cancel_requested_at)
        ).all()
    )


def start(
    request_id: str,
    owner: str,
    *,
    lease_timeout_s: float,
    max_attempts: int,
    worker: dict[str, Any] | None = None,
    url: str | None = None,
) -> dict[str, Any] | None:
    """A task's first store visit for its row, in one transaction: ``take`` it (from "queued",
    or from "running" when the lease is ``owner``'s own or expired, and fewer than
    ``max_attempts`` attempts were made), then read it. None when there is no such row, else
    a dict: ``taken`` (whether ``owner`` holds it now), ``id``, ``job_id``, ``status``,
    ``error``, ``attempts``, ``category``, ``prompt``, ``messages``, ``params``, ``output``
    (text, token_ids, finish_reason, prompt_tokens, output_tokens; None without one) and
    ``cancel_requested_at``, the job's cancel flag (``cancel --now``), and
    ``row_cancel_requested_at``, the row's own (``cancel_request``) (each None when not set)."""
    with writing(url) as s:
        taken = _take(s, request_id, owner, lease_timeout_s, max_attempts, worker)
        row = s.execute(
            select(Request, Output, Job.cancel_requested_at)
            .outerjoin(Output, Output.request_id == Request.id)
            .outerjoin(Job, Job.id == Request.job_id)
            .where(Request.id == request_id)
        ).first()
        if row is None:
            return None
        req, out, job_flag = row
        output = None
        if out is not None:
            output = {
                k: getattr(out, k) for k in ("text", "token_ids", "finish_reason", "prompt_tokens", "output_tokens")
            }
        fields = ("id", "job_id", "status", "error", "attempts", "category", "prompt", "messages", "params")
        return {
            "taken": taken,
            **{k: getattr(req, k) for k in fields},
            "output": output,
            "cancel_requested_at": job_flag,
            "row_cancel_requested_at": req.cancel_requested_at,
        }


def renew_leases(request_ids: Iterable[str], owner: str, *, url: str | None = None) -> dict[str, datetime]:
    """``renew``, and in the same transaction the cancel flags of the rows ``owner`` still
    holds: their jobs' (``cancel --now``) and their own (``cancel_request``), ``{job or
    request id: when its flag was written}`` (empty when none). A worker that missed a
    cancel's broadcast learns of it here."""
    request_ids = list(request_ids)
    if not request_ids:
        return {}
    found: dict[str, datetime] = {}
    with writing(url) as s:
        held = _beat_held(s, request_ids, owner)
        found.update((r.id, r.cancel_requested_at) for r in held if r.cancel_requested_at is not None)
        job_ids = sorted({r.job_id for r in held if r.job_id})
        for chunk in chunks(job_ids):
            rows = s.execute(
                select(Job.id, Job.cancel_requested_at).where(Job.id.in_(chunk), Job.cancel_requested_at.is_not(None))
            )
            found.update((job_id, when) for job_id, when in rows if when is not None)
    return found


def reclaim(lease_timeout_s: float, *, max_attempts: int | None = None, url: str | None = None) -> list[dict[str, Any]]:
    """Requeue every running row whose lease expired (no heartbeat for ``lease_timeout_s``):
    each such row moves back to "queued" (``requeues`` += 1) in one atomic UPDATE, so one
    caller gets it however many call at once. Rows that already had ``max_attempts``
    attempts fail instead (their worker keeps dying on them). Returns the requeued rows
    as ``[{"id", "pair"}]``: the caller enqueues them."""
    with writing(url) as s:
        now = db_now(s)
        cutoff = now - timedelta(seconds=lease_timeout_s)
        jobs: set[str] = set()
        if max_attempts is not None:
            failed = s.execute(
                update(Request)
                .where(_lost(cutoff), Request.attempts >= max_attempts)
                .values(
                    status="failed",
                    finished_at=now,
                    lease_owner=None,
                    heartbeat_at=None,
                    error=f"gave up after {max_attempts} attempts whose worker was lost each time "
                    "(killed: out of memory?)",
                )
                .returning(Request.job_id)
            ).all()
            jobs.update(r.job_id for r in failed if r.job_id)
        # a row's own flag, its job's `cancel --now`, or a `cancel JOB` made once the row existed
        cancelled_job = or_(Job.cancel_requested_at.is_not(None), Job.cancelled_at >= Request.created_at)
        stopping = or_(
            Request.cancel_requested_at.is_not(None),
            select(Job.id).where(Job.id == Request.job_id, cancelled_job).exists(),
        )
        cancelled = s.execute(  # lost rows of a cancelled job, or cancelled alone: not run again
            update(Request)
            .where(_lost(cutoff), stopping)
            .values(status="cancelled", error="cancelled", finished_at=now, lease_owner=None, heartbeat_at=None)
            .returning(Request.job_id)
            .execution_options(synchronize_session=False)
        ).all()
        jobs.update(r.job_id for r in cancelled if r.job_id)
        requeued = s.execute(
            update(Request)
            .where(_lost(cutoff))
            # (heartbeat_at: a queued row's last sending, which the caller does now: not sent twice by `unsent`)
            .values(status="queued", lease_owner=None, heartbeat_at=now, requeues=Request.requeues + 1)
            .returning(Request.id, Request.job_id, Request.pair_id)
        ).all()
        jobs.update(r.job_id for r in requeued if r.job_id)
        names = _pair_names(s, {r.pair_id for r in requeued})
        for job_id in jobs:
            refresh_job(s, job_id)
        return [{"id": r.id, "pair": names.get(r.pair_id)} for r in requeued]


def unsent(pair: str, older_than_s: float, *, url: str | None = None) -> list[str]:
    """Claim the rows of ``pair`` queued for over ``older_than_s`` whose message was not sent
    again as recently (their message may be lost: a worker killed between the broker handing
    it out and its row being taken, a broker restarted without persistence): a queued row's
    ``heartbeat_at`` notes when it was last sent again. One atomic UPDATE, so one caller gets
    each row however many ask at once. Returns their ids, for the caller to enqueue."""
    with writing(url) as s:
        now = db_now(s)
        cutoff = now - timedelta(seconds=older_than_s)
        pair_id = select(Pair.id).where(Pair.name == pair).scalar_subquery()
        rows = s.execute(
            update(Request)
            .where(
                Request.status == "queued",
                Request.pair_id == pair_id,
                Request.created_at < cutoff,
                or_(Request.heartbeat_at.is_(None), Request.heartbeat_at < cutoff),
            )
            .values(heartbeat_at=now)
            .returning(Request.id)
            .execution_options(synchronize_session=False)
        ).all()
        return [r.id for r in rows]


def _pair_names(session: Session, ids: Iterable[int | None]) -> dict[int, str]:
    known = [i for i in ids if i is not None]
    return dict(session.execute(select(Pair.id, Pair.name).where(Pair.id.in_(known))).all()) if known else {}


def counts(job_id: str, *, lease_timeout_s: float | None = None, url: str | None = None) -> dict[str, int]:
    """Rows of a job by state, plus ``lost`` (running, no heartbeat for ``lease_timeout_s``:
    about to be requeued) and ``requeued`` (pending again after losing their worker).
    Reads only."""
    check_schema(url)
    with session_scope(url) as s:
        by_status = dict(
            s.execute(
                select(Request.status, func.count()).where(Request.job_id == job_id).group_by(Request.status)
            ).all()
        )
        out = {k: by_status.get(k, 0) for k in (*PENDING, *FINISHED)}
        pending = Request.job_id == job_id
        out["requeued"] = (
            s.scalar(select(func.count()).where(pending, Request.status.in_(PENDING), Request.requeues > 0)) or 0
            if out["queued"] or out["running"]
            else 0
        )
        out["lost"] = 0
        if lease_timeout_s is not None and out["running"]:
            cutoff = db_now(s) - timedelta(seconds=lease_timeout_s)
            out["lost"] = s.scalar(select(func.count()).where(pending, _lost(cutoff))) or 0
    return out


def job_requests(job_id: str, *, outputs: bool = True, url: str | None = None) -> list[dict[str, Any]]:
    """Every request of a job (id, status, error, params, attempts, pair) in input order
    (``params["_row"]``), with its output and key telemetry when ``outputs``. Reads only."""
    columns = [Request.id, Request.status, Request.error, Request.params, Request.attempts, Pair.name.label("pair")]
    columns.append(Request.prompt.is_(None).label("messages_row"))  # (a row of chat messages has no prompt)
    q = select(*columns).outerjoin(Pair, Pair.id == Request.pair_id).where(Request.job_id == job_id)
    if outputs:
        q = (
            q.add_columns(
                Request.finished_at,
                Output.text,
                Output.finish_reason,
                Output.prompt_tokens,
                Output.output_tokens,
                Telemetry.tokens_per_s,
                Telemetry.acceptance_rate,
                Telemetry.mean_accepted_length,
                Telemetry.wall_time_s,
                Telemetry.time_to_first_token_s,
                Telemetry.draft_tokens_proposed,
                Telemetry.draft_tokens_accepted,
                Telemetry.drafter,
                Telemetry.baseline_s,
            )
            .outerjoin(Output, Output.request_id == Request.id)
            .outerjoin(Telemetry, Telemetry.request_id == Request.id)
        )
    check_schema(url)
    with session_scope(url) as s:
        out = [dict(r) for r in s.execute(q).mappings()]
    out.sort(key=lambda r: ((r["params"] or {}).get("_row", 0), r["id"]))
    return out


def requeue(
    job_id: str, *, lease_timeout_s: float, cancelled: bool = False, url: str | None = None
) -> list[dict[str, Any]]:
    """``retry``: failed rows (not those refused at submit: they would fail again), queued
    rows, running rows whose lease expired and, with ``cancelled``, cancelled rows go back
    to "queued", in one UPDATE; rows running under a live lease are left to their worker.
    The job's cancel flag (``cancel --now``) is cleared, and the partial outputs of cancelled
    rows run again are dropped (their new result is recorded in their place). Returns them
    as ``[{"id", "pair"}]`` (the caller enqueues them)."""
    with writing(url) as s:
        refuse_pruned(s, job_id)
        now = db_now(s)
        cutoff = now - timedelta(seconds=lease_timeout_s)
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested_at=None, cancelled_at=None))
        if cancelled:
            mine = select(Request.id).where(Request.job_id == job_id, Request.status == "cancelled")
            s.execute(
                delete(Telemetry).where(Telemetry.request_id.in_(mine)).execution_options(synchronize_session=False)
            )
            s.execute(delete(Output).where(Output.request_id.in_(mine)).execution_options(synchronize_session=False))
        refused = Request.params["_input_error"].as_string().is_not(None)
        again = [
            Request.status == "queued",
            _lost(cutoff),
            and_(Request.status == "failed", or_(Request.params.is_(None), ~refused)),
        ]
        if cancelled:
            again.append(Request.status == "cancelled")
        rows = s.execute(
            update(Request)
            .where(Request.job_id == job_id, or_(*again))
            .values(
                status="queued",
                error=None,
                lease_owner=None,
                heartbeat_at=now,  # (sent now, by the caller: not sent twice by `unsent`)
                cancel_requested_at=None,
                # a row that ended (failed, cancelled) gets its attempts again; a queued or lost
                # one keeps its count, which its stream's readers tell its attempts by
                attempts=case((Request.status.in_(("failed", "cancelled")), 0), else_=Request.attempts),
            )
            .returning(Request.id, Request.pair_id)
            .execution_options(synchronize_session=False)
        ).all()
        names = _pair_names(s, {r.pair_id for r in rows})
        refresh_job(s, job_id)
        return [{"id": r.id, "pair": names.get(r.pair_id)} for r in rows]


def refused_count(job_id: str, *, url: str | None = None) -> int:
    """Failed rows of a job that were refused at submit (bad input)."""
    check_schema(url)
    with session_scope(url) as s:
        refused = Request.params["_input_error"].as_string().is_not(None)
        return s.scalar(select(func.count()).where(Request.job_id == job_id, Request.status == "failed", refused)) or 0


def cancel(job_id: str, *, now: bool = False, at: datetime | None = None, url: str | None = None) -> int:
    """Cancel every queued row of a job in one UPDATE (running rows finish); how many.
    ``now``: also set the job's cancel flag (the time ``at``, naive UTC; default now), in the
    same transaction, so workers end its running rows at their next iteration (their partial
    text kept: ``end_cancelled``); a finished job (no row queued or running) gets no flag:
    nothing of it runs. Either way a running row whose worker is lost is then cancelled, not
    run again (``jobs.cancelled_at``: ``reclaim``)."""
    with writing(url) as s:
        flags: dict[str, datetime] = {"cancelled_at": db_now(s)}  # (reclaim compares it with rows' created_at)
        if now:
            flags["cancel_requested_at"] = at or utcnow()
        # first: whether any row is left to run, before the queued ones are cancelled
        s.execute(update(Job).where(Job.id == job_id, pending_rows(job_id)).values(**flags))
        rows = s.execute(
            update(Request)
            .where(Request.job_id == job_id, Request.status == "queued")
            .values(status="cancelled", error="cancelled", finished_at=utcnow())
            .returning(Request.id)
            .execution_options(synchronize_session=False)
        ).all()
        refresh_job(s, job_id)
        return len(rows)


def cancels_requested(job_ids: Iterable[str], *, url: str | None = None) -> set[str]:
    """Which of ``job_ids`` have their cancel flag set (``cancel --now``). Reads only."""
    return set(cancel_times(job_ids, url=url))


def cancel_times(job_ids: Iterable[str], *, url: str | None = None) -> dict[str, datetime]:
    """The jobs and rows of ``job_ids`` (job or request ids) whose cancel flag is set (``cancel
    --now``, ``cancel_request``), each with when it was written (naive UTC): primary-key
    lookups, what a worker's looker reads for the jobs and rows it is running. Reads only."""
    ids = list(job_ids)
    if not ids:
        return {}
    check_schema(url)
    found: dict[str, datetime] = {}
    with session_scope(url) as s:
        for chunk in chunks(ids):
            rows = s.execute(
                select(Job.id, Job.cancel_requested_at).where(Job.id.in_(chunk), Job.cancel_requested_at.is_not(None))
            )
            found.update((job_id, when) for job_id, when in rows if when is not None)
            own = s.execute(
                select(Request.id, Request.cancel_requested_at).where(
                    Request.id.in_(chunk), Request.cancel_requested_at.is_not(None)
                )
            )
            found.update((rid, when) for rid, when in own if when is not None)
    return found


def cancel_request(
    request_id: str, *, at: datetime | None = None, reason: str = "cancelled", url: str | None = None
) -> str:
    """Cancel one row: queued, it is cancelled now (``reason`` its error); running, its own
    cancel flag is set (the time ``at``, naive UTC; default now), and its worker ends it at its
    next iteration, its partial text kept (``end_cancelled``). Returns what became of it:
    "cancelled", "stopping", or its status when it had finished ("ok", "failed", "cancelled")
    or does not exist ("missing")."""
    with writing(url) as s:  # each step one conditional UPDATE: a worker taking the row meanwhile is seen
        queued = s.execute(
            update(Request)
            .where(Request.id == request_id, Request.status == "queued")
            .values(status="cancelled", error=reason, finished_at=utcnow(), cancel_requested_at=at or utcnow())
            .returning(Request.job_id)
        ).first()
        if queued is not None:
            if queued.job_id:
                refresh_job(s, queued.job_id)
            return "cancelled"
        running = s.execute(
            update(Request)
            .where(Request.id == request_id, Request.status == "running")
            .values(cancel_requested_at=at or utcnow())
            .returning(Request.id)
        ).first()
        if running is not None:
            return "stopping"
        return s.scalar(select(Request.status).where(Request.id == request_id)) or "missing"


def end_cancelled(
    request_id: str, result: dict[str, Any], *, iterations_after: int | None = None, url: str | None = None
) -> bool:
    """A running row stopped by ``cancel --now`` or ``cancel_request``: status "cancelled", its
    partial text and tokens kept as its output (finish reason "cancelled"), no telemetry
    (reports count finished rows); its error says after how many tokens, and
    ``iterations_after``: how many of its iterations ended after the cancel was written (its
    worker counts them). False when the row was not running (finished or requeued meanwhile)."""
    stats = result.get("stats") or {}
    tokens = int(stats.get("output_tokens") or len(result.get("token_ids") or []))
    late = "" if iterations_after is None else f" ({iterations_after} iterations after the cancel was written)"
    with writing(url) as s:
        now = utcnow()
        flags = s.execute(
            select(Request.cancel_requested_at, Job.cancel_requested_at)
            .outerjoin(Job, Job.id == Request.job_id)
            .where(Request.id == request_id)
        ).first()
        alone = flags is not None and flags[0] is not None and (flags[1] is None or flags[0] < flags[1])
        how = "its caller cancelled it" if alone else "cancel --now"  # (whichever was written first)
        changed = s.execute(
            update(Request)
            .where(Request.id == request_id, Request.status == "running")
            .values(
                status="cancelled",
                error=f"cancelled while running ({how}), after {tokens} tokens{late}; its partial text is kept",
                finished_at=now,
                lease_owner=None,
                heartbeat_at=None,
            )
            .returning(Request.job_id)
        ).first()
        if changed is None:
            return False
        s.execute(output_insert(s, request_id, result, "cancelled", tokens, now))
        if changed.job_id:
            row_changed(s, changed.job_id)
        return True
