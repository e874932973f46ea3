"""rollout progress: the rollout machine's settings and progress in typed columns, not the
free-form spec bag; manual canaries a kind of their own

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 05:45:00.000000

`rollout.spec` held 13 free-form keys. What a record is started with (policy, surge, all at once)
moves to `rollout.settings`, how far it has come (interval and step starts, the canary's restarts
at the step's start, the notified state, a pending promote, a restart's queue, done, current
instance and stage) to `rollout.progress`; the control plane reads both through pydantic models.
A record without `managed` was a manual canary: its kind becomes `manual`.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SETTINGS = ("policy", "surge", "all_at_once")
PROGRESS = {
    "interval_since": "interval_since",
    "step_since": "step_since",
    "restarts_at": "restarts_at",
    "notified_state": "notified_state",
    "promote": "pending",
    "queue": "queue",
    "done": "done",
    "current": "current",
    "stage": "stage",
}


def _document(value: Any) -> dict[str, Any]:
    """A JSON column's value: SQLite hands it back as text, PostgreSQL decoded."""
    if value is None:
        return {}
    return dict(json.loads(value) if isinstance(value, str) else value)


def _rollouts(columns: list[str]) -> sa.TableClause:
    return sa.table(
        "rollout",
        sa.column("id", sa.Integer()),
        sa.column("kind", sa.String()),
        *(sa.column(c, sa.JSON()) for c in columns),
    )


def upgrade() -> None:
    op.add_column("rollout", sa.Column("settings", sa.JSON(), nullable=False, server_default="{}"))
    op.add_column("rollout", sa.Column("progress", sa.JSON(), nullable=False, server_default="{}"))
    conn = op.get_bind()
    table = _rollouts(["spec", "settings", "progress"])
    for row_id, kind, spec in conn.execute(sa.select(table.c.id, table.c.kind, table.c.spec)):
        bag = _document(spec)
        settings = {k: bag[k] for k in SETTINGS if bag.get(k) is not None}
        progress = {new: bag[old] for old, new in PROGRESS.items() if bag.get(old) is not None}
        if kind == "rollout" and not bag.get("managed"):
            kind = "manual"  # set by hand: PUT /deployments/NAME/canary
        conn.execute(
            table.update()
            .where(table.c.id == row_id)
            .values(kind=kind, settings=settings, progress=progress)
        )
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.drop_column("spec")


def downgrade() -> None:
    op.add_column("rollout", sa.Column("spec", sa.JSON(), nullable=False, server_default="{}"))
    conn = op.get_bind()
    table = _rollouts(["spec", "settings", "progress"])
    rows = conn.execute(sa.select(table.c.id, table.c.kind, table.c.settings, table.c.progress))
    for row_id, kind, settings, progress in rows.all():
        bag: dict[str, Any] = dict(_document(settings))
        done = _document(progress)
        bag.update({old: done[new] for old, new in PROGRESS.items() if new in done})
        if kind == "manual":
            kind = "rollout"
        else:
            bag["managed"] = True
        conn.execute(table.update().where(table.c.id == row_id).values(kind=kind, spec=bag))
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.drop_column("progress")
        batch_op.drop_column("settings")
