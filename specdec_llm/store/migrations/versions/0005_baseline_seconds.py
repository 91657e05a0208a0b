"""telemetry.baseline_s: each request's target-only counterfactual (engine Stats.baseline_s),
the basis of the reports' speedup (sum of baseline_s over sum of wall_time_s).

The seconds the request would have taken decoding target-only in the process that ran it:
its time outside its iterations as it was, plus each output token at the target-only step
cost that process measured at the same batch size. The column joins the reports' covering
index (models.REPORT_COLUMNS), so the index is rebuilt.

Nullable: rows recorded before this revision have none (their group's speedup falls back to
the start-up calibration baselines, and says so).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 09:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BEFORE = [
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
]


def upgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.drop_index("ix_telemetry_report")
        batch_op.add_column(sa.Column("baseline_s", sa.Float(), nullable=True))
        batch_op.create_index("ix_telemetry_report", [*_BEFORE, "baseline_s"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.drop_index("ix_telemetry_report")
        batch_op.drop_column("baseline_s")
        batch_op.create_index("ix_telemetry_report", _BEFORE, unique=False)
