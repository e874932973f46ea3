"""logs: shipped log lines, the gateways' request summaries and per-token use for the audit

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 16:10:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "logline",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("host_id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=True),
        sa.Column("instance_id", sa.Integer(), nullable=True),
        sa.Column("source", sa.String(length=8), nullable=False),
        sa.Column("time", sa.DateTime(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("line", sa.Text(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=True),
        sa.Column("dropped", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["host_id"], ["host.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployment.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_logline_time", "logline", ["time"])
    op.create_index("ix_logline_deployment_time", "logline", ["deployment_id", "time"])
    op.create_index("ix_logline_instance", "logline", ["instance_id", "id"])
    op.create_table(
        "requestrecord",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("gateway", sa.String(length=128), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("time", sa.DateTime(), nullable=False),
        sa.Column("token", sa.String(length=63), nullable=False),
        sa.Column("version", sa.String(length=200), nullable=False),
        sa.Column("pool", sa.String(length=16), nullable=False),
        sa.Column("instance_id", sa.Integer(), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("steps_per_block", sa.Float(), nullable=True),
        sa.Column("tokens_per_forward", sa.Float(), nullable=True),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("latency_s", sa.Float(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["deployment_id"], ["deployment.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_requestrecord_request_id", "requestrecord", ["request_id"])
    op.create_index("ix_requestrecord_time", "requestrecord", ["time"])
    op.create_index("ix_requestrecord_deployment_time", "requestrecord", ["deployment_id", "time"])
    op.create_table(
        "tokenuse",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gateway", sa.String(length=128), nullable=False),
        sa.Column("token", sa.String(length=63), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("deployment", sa.String(length=63), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("ended_at", sa.DateTime(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("rate_limited", sa.BigInteger(), nullable=False),
        sa.Column("refused", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_tokenuse_ended_at", "tokenuse", ["ended_at"])
    op.create_index("ix_tokenuse_token_time", "tokenuse", ["token", "ended_at"])


def downgrade() -> None:
    op.drop_table("tokenuse")
    op.drop_table("requestrecord")
    op.drop_table("logline")
