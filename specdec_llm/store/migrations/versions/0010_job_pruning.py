"""jobs.pruning_at: ``prune`` has claimed the job, and deletes its rows a batch per transaction
until it is gone. A claimed job is deleted whole: ``retry`` and new rows refuse it (a retry
between two of prune's transactions used to keep a job with only some of its rows), and a
prune cut short finishes it on its next run.

jobs.cancelled_at: ``cancel JOB`` (without ``--now``) was asked while rows of it ran: they
finish, but one whose worker is lost is cancelled, not run again after the cancel.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07 04:10:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("pruning_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("cancelled_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("cancelled_at")
        batch_op.drop_column("pruning_at")
