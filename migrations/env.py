"""Alembic environment: runs the migrations on the connection that controlplane.migrate opens.

Self-contained on purpose: each revision describes the store as it was at that step, so nothing
here imports the control plane (its live models would make the arrow between the two run both
ways). The control plane hands over, in `config.attributes`, the open `connection` and its
models' `target_metadata` (what autogenerate compares against).
"""

from __future__ import annotations

from typing import Any, Literal

from alembic import context

config = context.config


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Render dctl's column types as plain SQLAlchemy types so migrations never import dctl."""
    if type_ == "type" and type(obj).__name__ == "UTCDateTime":
        return "sa.DateTime()"
    if type_ == "type" and type(obj).__name__ == "AutoString":
        length = getattr(obj, "length", None)
        return f"sa.String(length={length})" if length else "sa.String()"
    return False


def run_migrations() -> None:
    """Migrate on the connection passed in `config.attributes`; the caller commits."""
    connection = config.attributes.get("connection")
    if connection is None:
        raise RuntimeError(
            "dctl's migrations run through dctl, which opens the database: "
            "dctl db upgrade --db URL (or controlplane.migrate.upgrade)"
        )
    context.configure(
        connection=connection,
        target_metadata=config.attributes.get("target_metadata"),
        render_as_batch=connection.dialect.name == "sqlite",
        render_item=render_item,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
