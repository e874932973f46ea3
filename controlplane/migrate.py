"""Alembic helpers behind `dctl db ...` and `dctl server --migrate`.

The alembic configuration lives here in code and the scripts live in the `migrations`
package, so an installed wheel can migrate without an alembic.ini on disk. The arrow runs one
way: this module opens the database and hands the connection and the models' metadata to
`migrations/env.py`, which imports nothing of the control plane.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlmodel import SQLModel

import controlplane.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from controlplane.db import make_engine


class SchemaError(RuntimeError):
    """The database schema does not match what this dctl expects; the message says what to do."""


def _script_location() -> str:
    import migrations

    return str(Path(migrations.__file__).resolve().parent)


def alembic_config() -> Config:
    """An alembic Config pointing at the packaged migration scripts."""
    config = Config()
    config.set_main_option("script_location", _script_location())
    return config


def _on_database(url: str, step: Callable[[Config], None]) -> None:
    """Run an alembic command on one connection to `url`, committed when it succeeds."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            config = alembic_config()
            config.attributes["connection"] = conn
            config.attributes["target_metadata"] = SQLModel.metadata
            step(config)
            conn.commit()
    finally:
        engine.dispose()


def head() -> str:
    """The newest revision shipped with this dctl."""
    script = ScriptDirectory.from_config(alembic_config())
    revision = script.get_current_head()
    if revision is None:
        raise SchemaError("no migrations are packaged with this dctl")
    return revision


def upgrade(url: str, rev: str = "head") -> None:
    """Upgrade the database at `url` to `rev`."""
    _on_database(url, lambda config: command.upgrade(config, rev))


def downgrade(url: str, rev: str) -> None:
    """Downgrade the database at `url` to `rev` (`base` removes every table)."""
    _on_database(url, lambda config: command.downgrade(config, rev))


def current(url: str) -> str | None:
    """The revision the database is at, or None for an empty database."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def is_up_to_date(url: str) -> bool:
    """True when the database is at the newest packaged revision."""
    return current(url) == head()


def ensure_up_to_date(url: str) -> None:
    """Raise `SchemaError` telling the user to run `dctl db upgrade` when the schema is behind."""
    at, newest = current(url), head()
    if at != newest:
        raise SchemaError(
            f"database schema is at {at or 'nothing (empty database)'}, this dctl needs {newest}: "
            "run `dctl db upgrade` (or start with `dctl server --migrate`)"
        )


def drift(url: str) -> list[object]:
    """Differences between the migrated database and the models (empty = `alembic check` clean)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, SQLModel.metadata))
    finally:
        engine.dispose()
