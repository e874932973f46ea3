"""Migrations: up and down on SQLite and PostgreSQL, no drift from the models, behind = refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from controlplane import migrate
from controlplane.db import make_engine
from tests.controlplane.conftest import create_pg_database, drop_pg_database, require_postgres

EXPECTED_TABLES = {"host", "gpu", "model", "modelversion", "deployment", "instance", "rollout",
                   "event", "apitoken", "metricsample"}  # fmt: skip


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind (a fresh PostgreSQL database, dropped afterwards)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    require_postgres()
    url = create_pg_database()
    yield url
    drop_pg_database(url)


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    assert migrate.current(empty_url) is None
    assert not migrate.is_up_to_date(empty_url)
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    assert migrate.is_up_to_date(empty_url)
    assert tables(empty_url) == EXPECTED_TABLES
    migrate.downgrade(empty_url, "base")
    assert migrate.current(empty_url) is None
    assert tables(empty_url) == set()
    migrate.upgrade(empty_url)
    assert tables(empty_url) == EXPECTED_TABLES


def test_models_and_migrations_do_not_drift(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    assert migrate.drift(empty_url) == []


def test_a_database_behind_is_refused_with_what_to_run(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'behind.db'}"
    with pytest.raises(migrate.SchemaError, match="dctl db upgrade"):
        migrate.ensure_up_to_date(url)
    migrate.upgrade(url)
    migrate.ensure_up_to_date(url)


def test_sqlite_connections_use_wal_foreign_keys_and_busy_timeout(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'p.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    engine.dispose()


def test_migration_scripts_ship_inside_the_package() -> None:
    import migrations

    root = Path(migrations.__file__).parent
    assert (root / "env.py").is_file() and (root / "script.py.mako").is_file()
    assert (root / "versions" / "__init__.py").is_file()  # so setuptools packages the scripts
    assert migrate.head() == "0001"


def test_unsupported_database_urls_are_named() -> None:
    from controlplane.db import DatabaseUrlError

    with pytest.raises(DatabaseUrlError, match="sqlite:///PATH or postgresql"):
        make_engine("mysql://root@localhost/x")
