"""security II: pool-pinning grants and concurrency caps on tokens, labels a bootstrap token
stamps, and the labels an agent reports kept apart from the operator's

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 23:55:00.000000

`host.labels` are the operator's from now on (they count for placement); what an agent reports
goes to `host.reported_labels` and counts for nothing until adopted. Rows from before keep
their labels as the operator's, so an upgrade moves no instance, and a copy is kept as reported.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Plain ADD COLUMNs: SQLite's batch mode would copy host and apitoken, and dropping the old
    # host table cascades to its instances, GPUs and tokens.
    op.add_column(
        "apitoken",
        sa.Column("allow_pool_pin", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.add_column("apitoken", sa.Column("max_concurrency", sa.Integer(), nullable=True))
    op.add_column("apitoken", sa.Column("labels", sa.JSON(), nullable=True))
    op.add_column(
        "host", sa.Column("reported_labels", sa.JSON(), nullable=False, server_default="{}")
    )
    op.execute("UPDATE host SET reported_labels = labels")


def downgrade() -> None:
    with op.batch_alter_table("apitoken", schema=None) as batch_op:
        batch_op.drop_column("labels")
        batch_op.drop_column("max_concurrency")
        batch_op.drop_column("allow_pool_pin")
    op.drop_column("host", "reported_labels")
