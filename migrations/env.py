"""Alembic environment: runs migrations on the connection or URL that controlplane.migrate gives."""

from __future__ import annotations

from typing import Any, Literal

from alembic import context
from sqlmodel import SQLModel

import controlplane.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from controlplane.db import make_engine

config = context.config
target_metadata = SQLModel.metadata


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Render dctl's column types as plain SQLAlchemy types so migrations never import dctl."""
    if type_ == "type" and type(obj).__name__ == "UTCDateTime":
        return "sa.DateTime()"
    if type_ == "type" and type(obj).__name__ == "AutoString":
        length = getattr(obj, "length", None)
        return f"sa.String(length={length})" if length else "sa.String()"
    return False


def run_migrations() -> None:
    """Migrate using the connection passed in `config.attributes`, or a fresh engine."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


def _run(connection: Any) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        render_item=render_item,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations()
