"""monitoring: gateways that heartbeat (where they serve, their /metrics)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30 22:30:00.000000

Agents' metrics URLs need no column: they travel in the host facts (a JSON document).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gatewayprocess",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("scheme", sa.String(length=8), nullable=False),
        sa.Column("version", sa.String(length=64), nullable=False),
        sa.Column("metrics_url", sa.String(length=512), nullable=True),
        sa.Column("interval_s", sa.Float(), nullable=False),
        sa.Column("token_name", sa.String(length=63), nullable=False),
        sa.Column("first_seen_at", sa.DateTime(), nullable=False),
        sa.Column("last_seen_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("gatewayprocess", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_gatewayprocess_last_seen_at"), ["last_seen_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("gatewayprocess", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gatewayprocess_last_seen_at"))
    op.drop_table("gatewayprocess")
