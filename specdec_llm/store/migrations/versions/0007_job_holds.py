"""jobs.held_until: a command still using a finished job holds it, and ``prune`` leaves it.

``specdec-llm run`` holds its job from its submission until its results file is written (the
hold is renewed while it runs, so a ``run`` killed outright lets go by itself when its hold
expires). ``prune`` deletes only jobs that no hold covers now: a job whose last row just
finished is not deleted under a ``run`` that is still stopping its worker or exporting.

Nullable: NULL is "not held" (every job before this revision).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("held_until", sa.DateTime(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("held_until")
