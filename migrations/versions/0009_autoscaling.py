"""autoscaling: a deployment's policy, count and the autoscaler's clocks; an instance's standby
flag, retirement time and last reported load

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 15:40:00.000000

Every column is new and nullable or defaulted, so rows from before read as they were: no policy,
the count per host, no standby, nothing retiring, load not reported yet.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMNs: SQLite's batch mode would copy the tables.
    op.add_column("deployment", sa.Column("autoscale", sa.JSON(), nullable=True))
    op.add_column("deployment", sa.Column("replicas", sa.Integer(), nullable=True))
    op.add_column(
        "deployment",
        sa.Column("autoscale_state", sa.JSON(), nullable=False, server_default=sa.text("'{}'")),
    )
    op.add_column("deployment", sa.Column("wake_requested_at", sa.DateTime(), nullable=True))
    op.add_column(
        "instance", sa.Column("standby", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    op.add_column("instance", sa.Column("retire_at", sa.DateTime(), nullable=True))
    op.add_column("instance", sa.Column("requests_running", sa.Integer(), nullable=True))
    op.add_column("instance", sa.Column("requests_waiting", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Plain DROP COLUMNs (SQLite 3.35+): batch mode would recreate the deployment table, and
    # dropping the old one would cascade to its rollouts and instances.
    for column in ("requests_waiting", "requests_running", "retire_at", "standby"):
        op.drop_column("instance", column)
    for column in ("wake_requested_at", "autoscale_state", "replicas", "autoscale"):
        op.drop_column("deployment", column)
