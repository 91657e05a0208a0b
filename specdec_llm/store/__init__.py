"""The SQL store: requests, outputs, per-request telemetry, and reports over them.

Plain data in and out (dicts, ids, lists of dicts); ORM objects never leave the package.
The database is ``SPECDEC_DATABASE_URL`` (default: SQLite file ``specdec.db`` in the data
directory, WAL mode); PostgreSQL via ``postgresql+psycopg://user:pass@host/db``. Every
function takes ``url=`` to use another database. Times are naive UTC (``utcnow()``); those of
leases and liveness (heartbeats, lease cut-offs, holds) are the database's (``sql.db_now``), one
clock for every host sharing the store.

``db`` (engines, sessions, schema)
    get_engine(url=None) -> Engine
    session_scope(url=None) -> context manager yielding a Session (commit / rollback)
    upgrade(url=None, revision="head") -> str | None       # Alembic, migrations/
    downgrade(url, revision) -> str | None                 # "base" drops all tables
    current_revision(url=None) -> str | None;  head_revision() -> str
    ensure_schema(url=None)   # writers: empty/older database -> upgraded; else StoreError
    check_schema(url=None)    # readers: StoreError unless at head; writes nothing
    mask_url(url) -> str      # password hidden, for logs
    StoreError, SchemaError   # str(e) is one line saying what to do
    StoreUnavailable          # a StoreError: the database cannot be used now (try again later)
    TRANSIENT_ERRORS          # the tuple a caller retries on (StoreUnavailable and the driver's
                              # connection errors): callers never import SQLAlchemy

``record`` (writes; all idempotent, all upgrade an empty/older database first)
    upsert_pair(name, *, target, draft, target_fingerprint, draft_fingerprint, dtype, device) -> int
    upsert_worker(worker: dict) -> int          # keys of worker_info(device_name)
    worker_info(device_name) -> dict            # this process: host, pid, versions
    record_baseline(pair, *, device, dtype, tokens_per_s, source="calibration"|"shadow", samples=1) -> dict
    create_job(requests, *, name, pair, params, job_id, hold_s=None) -> {"job_id", "request_ids", "created"}
    MAX_JOB_NAME_CHARS, MAX_CATEGORY_CHARS    # the longest job name and row category a store holds
    hold_job(job_id, hold_s) -> bool;  release_job(job_id)   # a job in use: prune leaves it
    mark_request(request_id, status, *, error, worker) -> bool   # queued/running/failed/cancelled
    record_result(request_id, result, *, worker, device, queue_wait_s, pair, job_id, price_per_hour,
                  dtype=None, category=None, finished_at=None) -> bool  # False: already recorded
    get_request(request_id) -> dict | None;  get_job(job_id) -> dict | None
    get_stats(request_id) -> dict               # its telemetry as engine Stats fields ({} if none)

``jobs`` (leases and job-wide operations, set-based)
    take(request_id, owner, *, lease_timeout_s, worker=None) -> bool   # start a row under a lease
    start(request_id, owner, *, lease_timeout_s, max_attempts, worker=None) -> dict | None  # take + read, one transaction
    renew(request_ids, owner) -> int;  reclaim(lease_timeout_s, *, max_attempts=None) -> [{"id", "pair"}]
    renew_leases(request_ids, owner) -> {job or row: when}   # renew + the held rows' (and jobs') cancel flags
    counts(job_id, *, lease_timeout_s=None) -> {status: n, "lost", "requeued"}
    requeue(job_id, *, lease_timeout_s, cancelled=False) -> [{"id", "pair"}]
    cancel(job_id, *, now=False) -> int;  refused_count(job_id)
    cancels_requested(job_ids) -> set;  cancel_times(ids) -> {job or row: when}   # cancel --now
    cancel_request(request_id, *, at=None, reason="cancelled") -> "cancelled"|"stopping"|status  # one row
    end_cancelled(request_id, result, *, iterations_after=None) -> bool
    job_requests(job_id, *, outputs=True) -> [dict]   # every row, its output and key telemetry, input order

``admin`` (operating: ``specdec-llm jobs | workers | prune``)
    list_jobs(*, state, name, since, limit=20) -> [dict]   # newest first, rows by state, tokens/s
    heartbeat_worker(worker, *, pair, dtype, max_batch, rows_done, output_tokens, tokens_per_s)
    worker_stopped(worker, *, rows_done, output_tokens)    # a clean stop: its last counts, no heartbeat
    list_workers(*, stale_after_s, since=None) -> [dict]   # by heartbeat; stale and stopped ones marked
    prune_plan(cutoff, *, job_id=None) -> {"jobs", "rows", "unfinished"}
    prune(cutoff, *, job_id=None, batch_rows=5000) -> {"jobs", "rows", "outputs", "telemetry"}

``reports`` (reads only)
    summary(since=None, until=None, group_by=("pair",), pair=None, job=None,
            price_per_hour=None, url=None) -> list[dict]
    GROUP_FIELDS, METRICS, ReportInputError
    parse_prices(value, option="--price-per-hour") -> {device kind: USD/hour};  price_for(value, device) -> float | None
                              # the one price parser (value None: SPECDEC_PRICE_PER_HOUR)

``render``: to_tables (fitted to a width) / to_table / table_text / to_csv / to_json / to_html, and
    report(fmt, **summary filters) -> str   # query + render, "table"|"csv"|"json"|"html"

``cli.register(app)`` adds ``db upgrade|downgrade|current`` and ``report`` to a Typer app.
``sql``: the writers' shared steps (``writing(url)`` session, ``dialect_insert``, ``chunks``, ``db_now``).
``testing``: ``sqlite_url(dir)``, ``temporary_postgres()`` (a database created and dropped).

Concurrency: writes use INSERT ... ON CONFLICT, so duplicate deliveries race safely; the
first upgrade of an empty database is serialised (PostgreSQL advisory lock, a lock file
beside a SQLite file); a forked child (Celery prefork) gets fresh connections.
"""

from .db import (
    TRANSIENT_ERRORS,
    SchemaError,
    StoreError,
    StoreUnavailable,
    check_schema,
    downgrade,
    ensure_schema,
    get_engine,
    mask_url,
    session_scope,
    upgrade,
)
from .models import MAX_CATEGORY_CHARS, MAX_JOB_NAME_CHARS, PENDING, utcnow
from .record import (
    create_job,
    get_job,
    get_request,
    get_stats,
    hold_job,
    mark_request,
    record_baseline,
    record_result,
    release_job,
    upsert_pair,
    upsert_worker,
    worker_info,
)
from .reports import ReportInputError, price_for, summary

__all__ = [
    "MAX_CATEGORY_CHARS",
    "MAX_JOB_NAME_CHARS",
    "PENDING",
    "TRANSIENT_ERRORS",
    "ReportInputError",
    "SchemaError",
    "StoreError",
    "StoreUnavailable",
    "check_schema",
    "create_job",
    "downgrade",
    "ensure_schema",
    "get_engine",
    "get_job",
    "get_request",
    "get_stats",
    "hold_job",
    "mark_request",
    "mask_url",
    "price_for",
    "record_baseline",
    "record_result",
    "release_job",
    "session_scope",
    "summary",
    "upgrade",
    "upsert_pair",
    "upsert_worker",
    "utcnow",
    "worker_info",
]
