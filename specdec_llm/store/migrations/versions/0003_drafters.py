"""telemetry.drafter and telemetry.drafter_tokens: which drafters proposed a request's draft
tokens (engine Stats.drafter: the one that proposed most; Stats.drafter_tokens: proposed and
accepted per drafter). ``report --group-by drafter`` reads the first.

Nullable: rows recorded before this revision have neither.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 20:30:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.add_column(sa.Column("drafter", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("drafter_tokens", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.drop_column("drafter_tokens")
        batch_op.drop_column("drafter")
