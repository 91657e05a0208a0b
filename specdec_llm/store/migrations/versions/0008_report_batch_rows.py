"""telemetry.batch_rows joins the reports' covering index (models.REPORT_COLUMNS): a row decoded
beside others is charged its share of the device, wall time / batch rows (4 rows decoded
together for 10 s are 10 device-seconds, not 40), so the reports read the column.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 19:00:00.000000
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
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
    "baseline_s",
]


def upgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.drop_index("ix_telemetry_report")
        batch_op.create_index("ix_telemetry_report", [*_BEFORE, "batch_rows"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("telemetry") as batch_op:
        batch_op.drop_index("ix_telemetry_report")
        batch_op.create_index("ix_telemetry_report", _BEFORE, unique=False)
