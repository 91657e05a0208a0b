"""Operating bulk jobs: worker heartbeats, a job's cancel flag, and the indexes that list jobs.

- ``workers``: what a worker's heartbeat records (every ``SPECDEC_LEASE_HEARTBEAT_S`` from the
  process that holds the pair): the pair, dtype and batch size it serves, rows done, output
  tokens and recent tokens/s, and ``heartbeat_at`` (``specdec-llm workers`` lists workers by
  it and marks those whose heartbeat is older than the lease timeout stale). Rows from
  before this revision have no heartbeat and are not listed.
- ``jobs.cancel_requested_at``: set by ``cancel --now``; workers poll it and end a running row
  at its next iteration, keeping its partial text. Cleared when the job's rows are retried.
- indexes for ``specdec-llm jobs`` (newest first, optionally by state) and ``prune`` (finished
  jobs older than a cutoff): ``(created_at, id)`` and ``(status, created_at, id)``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 08:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("cancel_requested_at", sa.DateTime(), nullable=True))
        batch_op.create_index("ix_jobs_created", ["created_at", "id"], unique=False)
        batch_op.create_index("ix_jobs_status_created", ["status", "created_at", "id"], unique=False)
    with op.batch_alter_table("workers") as batch_op:
        batch_op.add_column(sa.Column("pair", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("dtype", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("max_batch", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("rows_done", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("output_tokens", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("tokens_per_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("heartbeat_at", sa.DateTime(), nullable=True))
        batch_op.create_index("ix_workers_heartbeat_at", ["heartbeat_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch_op:
        batch_op.drop_index("ix_workers_heartbeat_at")
        for column in ("heartbeat_at", "tokens_per_s", "output_tokens", "rows_done", "max_batch", "dtype", "pair"):
            batch_op.drop_column(column)
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_status_created")
        batch_op.drop_index("ix_jobs_created")
        batch_op.drop_column("cancel_requested_at")
