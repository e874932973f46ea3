"""rollout progress: the rollout machine's progress in typed columns, not the free-form spec bag

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 05:45:00.000000
"""

from __future__ import annotations

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Filled in with the typed progress columns (issue 27)."""


def downgrade() -> None:
    """The inverse of upgrade."""
