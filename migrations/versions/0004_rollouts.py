"""rollouts: kinds, plan progress and policy of rollouts; deployments' rollback target

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 19:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rows from before were manual canaries: kind rollout, no timed plan.
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=16), nullable=False, server_default="rollout")
        )
        batch_op.add_column(sa.Column("spec", sa.JSON(), nullable=False, server_default="{}"))
        batch_op.add_column(sa.Column("engine_config", sa.JSON(), nullable=True))
        batch_op.add_column(
            sa.Column("phase", sa.String(length=16), nullable=False, server_default="waiting")
        )
        batch_op.add_column(sa.Column("step_started_at", sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column("paused_left_s", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(
            sa.Column("actor", sa.String(length=128), nullable=False, server_default="")
        )
        batch_op.add_column(sa.Column("ticked_at", sa.DateTime(), nullable=True))

    # Plain ADD COLUMNs, no foreign key: SQLite's batch mode would copy the deployment table,
    # and dropping the old copy cascades to every instance row. A version that is gone by the
    # time of a rollback is reported as such.
    op.add_column(
        "deployment", sa.Column("rollout_policy", sa.JSON(), nullable=False, server_default="{}")
    )
    op.add_column(
        "deployment",
        sa.Column("rollback_version_id", sa.Integer(), nullable=True),
    )
    op.add_column("deployment", sa.Column("rollback_engine_config", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("deployment", schema=None) as batch_op:
        batch_op.drop_column("rollback_engine_config")
        batch_op.drop_column("rollback_version_id")
        batch_op.drop_column("rollout_policy")

    with op.batch_alter_table("rollout", schema=None) as batch_op:
        for column in ("ticked_at", "actor", "failures", "paused_left_s", "step_started_at",
                       "phase", "engine_config", "spec", "kind"):  # fmt: skip
            batch_op.drop_column(column)
