"""Initial schema: pairs, workers, jobs, requests, outputs, telemetry, baselines.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 03:47:20.802478
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "pairs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("target", sa.String(length=500), nullable=True),
        sa.Column("target_fingerprint", sa.String(length=128), nullable=True),
        sa.Column("draft", sa.String(length=500), nullable=True),
        sa.Column("draft_fingerprint", sa.String(length=128), nullable=True),
        sa.Column("dtype", sa.String(length=32), nullable=True),
        sa.Column("device", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pairs")),
        sa.UniqueConstraint("name", name=op.f("uq_pairs_name")),
    )
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("device_name", sa.String(length=200), nullable=False),
        sa.Column("torch_version", sa.String(length=64), nullable=True),
        sa.Column("transformers_version", sa.String(length=64), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("host", "pid", "device_name", name=op.f("uq_workers_host_pid_device_name")),
    )
    op.create_table(
        "baselines",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pair_id", sa.Integer(), nullable=False),
        sa.Column("device_kind", sa.String(length=32), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("measured_at", sa.DateTime(), nullable=False),
        sa.CheckConstraint("source IN ('calibration', 'shadow')", name=op.f("ck_baselines_source")),
        sa.ForeignKeyConstraint(["pair_id"], ["pairs.id"], name=op.f("fk_baselines_pair_id_pairs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_baselines")),
        sa.UniqueConstraint("pair_id", "device_kind", "dtype", name=op.f("uq_baselines_pair_id_device_kind_dtype")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("pair_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("n_requests", sa.Integer(), nullable=False),
        sa.Column("n_ok", sa.Integer(), nullable=False),
        sa.Column("n_failed", sa.Integer(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint("status IN ('queued', 'running', 'done')", name=op.f("ck_jobs_status")),
        sa.ForeignKeyConstraint(["pair_id"], ["pairs.id"], name=op.f("fk_jobs_pair_id_pairs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_table(
        "requests",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("pair_id", sa.Integer(), nullable=True),
        sa.Column("worker_id", sa.Integer(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("category", sa.String(length=100), nullable=True),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("messages", sa.JSON(), nullable=True),
        sa.Column("params", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'ok', 'failed', 'cancelled')", name=op.f("ck_requests_status")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_requests_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["pair_id"], ["pairs.id"], name=op.f("fk_requests_pair_id_pairs")),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"], name=op.f("fk_requests_worker_id_workers")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_requests_idempotency_key")),
    )
    op.create_index("ix_requests_job_status", "requests", ["job_id", "status"], unique=False)
    op.create_index("ix_requests_status_finished", "requests", ["status", "finished_at"], unique=False)
    op.create_table(
        "outputs",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.JSON(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"], ["requests.id"], name=op.f("fk_outputs_request_id_requests"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_outputs")),
    )
    op.create_table(
        "telemetry",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("pair_id", sa.Integer(), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("worker_id", sa.Integer(), nullable=True),
        sa.Column("category", sa.String(length=100), nullable=True),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("device_kind", sa.String(length=32), nullable=False),
        sa.Column("dtype", sa.String(length=32), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=False),
        sa.Column("queue_wait_s", sa.Float(), nullable=True),
        sa.Column("price_per_hour", sa.Float(), nullable=True),
        sa.Column("estimated_cost_usd", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("draft_tokens_proposed", sa.Integer(), nullable=False),
        sa.Column("draft_tokens_accepted", sa.Integer(), nullable=False),
        sa.Column("acceptance_rate", sa.Float(), nullable=False),
        sa.Column("mean_accepted_length", sa.Float(), nullable=False),
        sa.Column("per_position_acceptance", sa.JSON(), nullable=True),
        sa.Column("target_forwards", sa.Integer(), nullable=False),
        sa.Column("draft_forwards", sa.Integer(), nullable=False),
        sa.Column("draft_time_s", sa.Float(), nullable=False),
        sa.Column("target_time_s", sa.Float(), nullable=False),
        sa.Column("wall_time_s", sa.Float(), nullable=False),
        sa.Column("time_to_first_token_s", sa.Float(), nullable=False),
        sa.Column("tokens_per_s", sa.Float(), nullable=False),
        sa.Column("k_values", sa.JSON(), nullable=True),
        sa.Column("finish_reason", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_telemetry_job_id_jobs"), ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["pair_id"], ["pairs.id"], name=op.f("fk_telemetry_pair_id_pairs")),
        sa.ForeignKeyConstraint(
            ["request_id"], ["requests.id"], name=op.f("fk_telemetry_request_id_requests"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["worker_id"], ["workers.id"], name=op.f("fk_telemetry_worker_id_workers")),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_telemetry")),
    )
    # covering index for the reports (models.REPORT_COLUMNS)
    op.create_index(
        "ix_telemetry_report",
        "telemetry",
        [
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
        ],
        unique=False,
    )


def downgrade() -> None:
    op.drop_index("ix_telemetry_report", table_name="telemetry")
    op.drop_table("telemetry")
    op.drop_table("outputs")
    op.drop_index("ix_requests_status_finished", table_name="requests")
    op.drop_index("ix_requests_job_status", table_name="requests")
    op.drop_table("requests")
    op.drop_table("jobs")
    op.drop_table("baselines")
    op.drop_table("workers")
    op.drop_table("pairs")
