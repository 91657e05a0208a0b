"""requests.cancel_requested_at: one row's own cancel flag (``cancel_request``), beside its job's
(``jobs.cancel_requested_at``, ``cancel JOB --now``). A caller that stops reading a stream, or
whose call timed out, stops its row alone: the worker ends it at its next iteration.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06 22:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch_op:
        batch_op.add_column(sa.Column("cancel_requested_at", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch_op:
        batch_op.drop_column("cancel_requested_at")
