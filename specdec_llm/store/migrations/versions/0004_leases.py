"""Leases on running requests: requests.lease_owner, heartbeat_at, requeues.

A worker that takes a row writes its Celery node name and a heartbeat, and renews the
heartbeat while the row runs. A running row whose heartbeat is older than the lease
timeout lost its worker: it goes back to the queue (``requeues`` += 1). The index serves
that search (status = 'running' AND heartbeat_at < cutoff).

Depends on 0003 (drafter telemetry).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 12:00:00.000000
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch_op:
        batch_op.add_column(sa.Column("lease_owner", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("heartbeat_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("requeues", sa.Integer(), nullable=False, server_default="0"))
        batch_op.create_index("ix_requests_status_heartbeat", ["status", "heartbeat_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch_op:
        batch_op.drop_index("ix_requests_status_heartbeat")
        batch_op.drop_column("requeues")
        batch_op.drop_column("heartbeat_at")
        batch_op.drop_column("lease_owner")
