"""The store's tables: SQLAlchemy 2 typed ORM models.

All times are naive UTC. ``telemetry`` is the report table: besides every engine
``Stats`` field it carries copies of the request's pair, job, worker, category and the
device kind/dtype, so a report reads one table (plus the tiny ``baselines``) and never
joins ``requests`` row by row.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Every constraint and index gets a predictable name, so migrations (and SQLite's
# batch mode, which recreates tables) can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

REQUEST_STATUSES = ("queued", "running", "ok", "failed", "cancelled")
JOB_STATUSES = ("queued", "running", "done")
PENDING = ("queued", "running")  # a request not finished yet
MAX_JOB_NAME_CHARS = 200  # jobs.name: a longer name cannot be stored (PostgreSQL refuses it)
MAX_CATEGORY_CHARS = 100  # requests.category: idem
BASELINE_SOURCES = ("calibration", "shadow")
# The engine's Stats fields, each a telemetry column of the same name (a test keeps this
# in step with specdec_llm.engine.types.Stats; the store does not import the engine/torch).
STATS_FIELDS = (
    "prompt_tokens",
    "output_tokens",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "acceptance_rate",
    "mean_accepted_length",
    "per_position_acceptance",
    "target_forwards",
    "draft_forwards",
    "draft_time_s",
    "target_time_s",
    "wall_time_s",
    "time_to_first_token_s",
    "tokens_per_s",
    "k_values",
    "drafter_tokens",
    "drafter",
    "batch_rows",
    "baseline_s",
    "finish_reason",
)


# Telemetry columns the reports read, in the order of their covering index.
REPORT_COLUMNS = (
    "pair_id",
    "finished_at",
    "job_id",
    "worker_id",
    "category",
    "device_kind",
    "dtype",
    "prompt_tokens",
    "output_tokens",
    "draft_tokens_proposed",
    "draft_tokens_accepted",
    "mean_accepted_length",
    "tokens_per_s",
    "wall_time_s",
    "time_to_first_token_s",
    "estimated_cost_usd",
    "baseline_s",
    "batch_rows",  # (a batched row's share of its device: wall time / batch rows)
)


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: DateTime(), dict[str, Any]: JSON, float: Float()}


class Pair(Base):
    """A draft/target pair as loaded: identities, fingerprints, dtype and device."""

    __tablename__ = "pairs"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    target: Mapped[str | None] = mapped_column(String(500))
    target_fingerprint: Mapped[str | None] = mapped_column(String(128))
    draft: Mapped[str | None] = mapped_column(String(500))
    draft_fingerprint: Mapped[str | None] = mapped_column(String(128))
    dtype: Mapped[str | None] = mapped_column(String(32))
    device: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class Worker(Base):
    """One worker process: where it ran and with which library versions; since 0006 also what
    its heartbeat says (the pair it serves, its batch size, rows done, recent tokens/s)."""

    __tablename__ = "workers"
    __table_args__ = (
        UniqueConstraint("host", "pid", "device_name"),
        Index("ix_workers_heartbeat_at", "heartbeat_at"),  # `specdec-llm workers` (0006)
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    device_name: Mapped[str] = mapped_column(String(200))
    torch_version: Mapped[str | None] = mapped_column(String(64))
    transformers_version: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    # the heartbeat (0006), written every SPECDEC_LEASE_HEARTBEAT_S by the process holding the pair
    pair: Mapped[str | None] = mapped_column(String(200))
    dtype: Mapped[str | None] = mapped_column(String(32))
    max_batch: Mapped[int | None]
    rows_done: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    tokens_per_s: Mapped[float | None]  # over the last minute
    heartbeat_at: Mapped[datetime | None]


class Job(Base):
    """A batch of requests (one submitted file, one LangChain .batch call...)."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_in("status", JOB_STATUSES), name="status"),
        Index("ix_jobs_created", "created_at", "id"),  # `specdec-llm jobs`: newest first (0006)
        Index("ix_jobs_status_created", "status", "created_at", "id"),  # ... of one state; prune
    )
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(MAX_JOB_NAME_CHARS))
    pair_id: Mapped[int | None] = mapped_column(ForeignKey("pairs.id"))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    n_requests: Mapped[int] = mapped_column(default=0)
    n_ok: Mapped[int] = mapped_column(default=0)
    n_failed: Mapped[int] = mapped_column(default=0)
    params: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # `cancel --now` (0006): workers end the job's running rows at their next iteration
    cancel_requested_at: Mapped[datetime | None]
    # a command still using the job (`run`, until its results file is written) holds it until
    # then, renewing the hold while it runs (0007): `prune` leaves a held job alone
    held_until: Mapped[datetime | None]
    # `prune` claimed the job (0010): it deletes the job whole, a batch of rows per transaction;
    # `retry` and new rows refuse a claimed job
    pruning_at: Mapped[datetime | None]
    # `cancel JOB` asked while rows of it ran (0010): they finish, but one whose worker is lost
    # is cancelled by `reclaim`, not run again; retry and rows added once none is left clear it
    cancelled_at: Mapped[datetime | None]


class Request(Base):
    """One generation request and its lifecycle (queued -> running -> ok | failed)."""

    __tablename__ = "requests"
    __table_args__ = (
        CheckConstraint(_in("status", REQUEST_STATUSES), name="status"),
        Index("ix_requests_job_status", "job_id", "status"),
        Index("ix_requests_status_finished", "status", "finished_at"),
        Index("ix_requests_status_heartbeat", "status", "heartbeat_at"),  # lost leases (0004)
    )
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    pair_id: Mapped[int | None] = mapped_column(ForeignKey("pairs.id"))
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("workers.id"))
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    category: Mapped[str | None] = mapped_column(String(MAX_CATEGORY_CHARS))
    prompt: Mapped[str | None] = mapped_column(Text)
    messages: Mapped[list[Any] | None] = mapped_column(JSON)
    params: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(16), default="queued")
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(default=0)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # The lease of a running row (0004): the Celery node holding it and its last heartbeat;
    # a row whose heartbeat stops goes back to the queue (``requeues`` counts those times).
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None]
    requeues: Mapped[int] = mapped_column(default=0)
    # This row's own cancel flag (0009; ``jobs.cancel_request``): its worker ends it at its next
    # iteration, as a job's flag (``cancel --now``) ends every running row of the job.
    cancel_requested_at: Mapped[datetime | None]


class Output(Base):
    """What a request produced."""

    __tablename__ = "outputs"
    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[list[int]] = mapped_column(JSON)
    prompt_tokens: Mapped[int]
    output_tokens: Mapped[int]
    finish_reason: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Telemetry(Base):
    """Per-request telemetry: every engine ``Stats`` field plus where, when and what it cost."""

    __tablename__ = "telemetry"
    __table_args__ = (
        # Covering index for the reports: every column a report reads, pair first so the
        # default per-pair report needs no sort. A report reads this compact index, never
        # the wide rows. (No other index here: SQLite would pick a narrower one for its
        # order and then fetch every row from the table, 2-3x slower.)
        Index("ix_telemetry_report", *REPORT_COLUMNS),
    )
    request_id: Mapped[str] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), primary_key=True)
    # Copies of the request's context (denormalised for the reports).
    pair_id: Mapped[int | None] = mapped_column(ForeignKey("pairs.id"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("workers.id"))
    category: Mapped[str | None] = mapped_column(String(100))
    device: Mapped[str] = mapped_column(String(64))  # as the worker named it, e.g. "cuda:0"
    device_kind: Mapped[str] = mapped_column(String(32))  # "cuda", "cpu", "mps": prices and baselines key on it
    dtype: Mapped[str | None] = mapped_column(String(32))
    finished_at: Mapped[datetime] = mapped_column(default=utcnow)
    queue_wait_s: Mapped[float | None]
    price_per_hour: Mapped[float | None]
    estimated_cost_usd: Mapped[float | None]
    # engine Stats, field for field
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    draft_tokens_proposed: Mapped[int] = mapped_column(default=0)
    draft_tokens_accepted: Mapped[int] = mapped_column(default=0)
    acceptance_rate: Mapped[float] = mapped_column(default=0.0)
    mean_accepted_length: Mapped[float] = mapped_column(default=0.0)
    per_position_acceptance: Mapped[list[float] | None] = mapped_column(JSON)
    target_forwards: Mapped[int] = mapped_column(default=0)
    draft_forwards: Mapped[int] = mapped_column(default=0)
    draft_time_s: Mapped[float] = mapped_column(default=0.0)
    target_time_s: Mapped[float] = mapped_column(default=0.0)
    wall_time_s: Mapped[float] = mapped_column(default=0.0)
    time_to_first_token_s: Mapped[float] = mapped_column(default=0.0)
    tokens_per_s: Mapped[float] = mapped_column(default=0.0)
    k_values: Mapped[list[int] | None] = mapped_column(JSON)
    batch_rows: Mapped[float | None]  # mean batch size the request decoded in (None: recorded before 0002)
    drafter: Mapped[str | None] = mapped_column(String(32))  # the drafter that proposed most ("none"; None before 0003)
    drafter_tokens: Mapped[dict[str, Any] | None]  # drafter -> {"proposed", "accepted", "drafts", ...}
    # target-only counterfactual seconds (0005): the speedup's basis; None before 0005
    baseline_s: Mapped[float | None]
    finish_reason: Mapped[str] = mapped_column(String(16), default="length")


class Baseline(Base):
    """Target-only decoding speed for a pair on a device kind and dtype."""

    __tablename__ = "baselines"
    __table_args__ = (
        UniqueConstraint("pair_id", "device_kind", "dtype"),
        CheckConstraint(_in("source", BASELINE_SOURCES), name="source"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    pair_id: Mapped[int] = mapped_column(ForeignKey("pairs.id", ondelete="CASCADE"))
    device_kind: Mapped[str] = mapped_column(String(32))
    dtype: Mapped[str] = mapped_column(String(32))
    tokens_per_s: Mapped[float]
    samples: Mapped[int] = mapped_column(Integer, default=1)
    source: Mapped[str] = mapped_column(String(16))
    measured_at: Mapped[datetime] = mapped_column(default=utcnow)
