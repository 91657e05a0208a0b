"""telemetry.batch_rows: the mean batch size a request decoded in (engine Stats.batch_rows).

Nullable: rows recorded before this revision (and results without the field) have none.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.add_column(sa.Column("batch_rows", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.drop_column("batch_rows")
