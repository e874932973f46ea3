"""instance spec generation: an instance counts as serving its version only once its host's agent
has applied the desired state that gave it that spec

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 13:05:00.000000

A version that changes only the engine config (a config rollout, or the rollback from one) has
the stable version's weights digest, so "ready and reporting the version's digest" held for the
engine about to be replaced: the rollout promoted the next instance at once and the gateway
routed the new version's requests to the old engine. `instance.spec_generation` is the host's
desired generation that carried the instance's current version; rows from before get 0
(applied by every host).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A plain ADD COLUMN: SQLite's batch mode would copy the instance table.
    op.add_column(
        "instance",
        sa.Column("spec_generation", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    with op.batch_alter_table("instance", schema=None) as batch_op:
        batch_op.drop_column("spec_generation")
