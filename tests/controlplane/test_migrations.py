"""Migrations: up and down on SQLite and PostgreSQL, no drift from the models, behind = refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from controlplane import migrate
from controlplane.db import make_engine
from tests.controlplane.conftest import create_pg_database, drop_pg_database, require_postgres

EXPECTED_TABLES = {"host", "gpu", "model", "modelversion", "deployment", "instance", "rollout",
                   "event", "apitoken", "metricsample", "lease", "trafficwindow",
                   "gatewayprocess", "logline", "requestrecord", "tokenuse"}  # fmt: skip


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
    assert migrate.head() == "0010"


def test_upgrading_to_0002_gives_existing_instances_a_key_and_their_hosts_the_news(
    empty_url: str,
) -> None:
    migrate.upgrade(empty_url, "0001")
    engine = make_engine(empty_url)
    now = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO host (id, name, labels, state, draining, registered_at, "
                "heartbeat_interval_s, port_range_start, port_range_end, facts, gpu_samples, "
                "desired_generation, applied_generation) VALUES (1, 'gpu-a', '{}', 'ready', "
                f"false, '{now}', 5, 18000, 18099, '{{}}', '[]', 3, 3)"
            )
        )
        conn.execute(sa.text(f"INSERT INTO model (id, name, created_at) VALUES (1, 'm', '{now}')"))
        conn.execute(
            sa.text(
                "INSERT INTO modelversion (id, model_id, version, line, digest, manifest, "
                "total_bytes, source_uri, notes, deprecated, created_at) VALUES (1, 1, 'v1', "
                f"'base', '{'0' * 64}', '[]', 0, '/w', '', false, '{now}')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO deployment (id, name, model_id, stable_version_id, engine_config, "
                "placement_hosts, placement_labels, instances_per_host, created_at, updated_at) "
                f"VALUES (1, 'web', 1, 1, '{{}}', '[]', '{{}}', 2, '{now}', '{now}')"
            )
        )
        for instance_id, port in ((1, 18000), (2, 18001)):
            conn.execute(
                sa.text(
                    "INSERT INTO instance (id, deployment_id, host_id, version_id, ordinal, port, "
                    "desired_state, observed_state, restart_count, message, created_at) VALUES "
                    f"({instance_id}, 1, 1, 1, {instance_id - 1}, {port}, 'running', 'ready', 0, "
                    f"'', '{now}')"
                )
            )
    engine.dispose()
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT api_key FROM instance ORDER BY id")).scalars().all()
        generation = conn.execute(sa.text("SELECT desired_generation FROM host")).scalar()
    engine.dispose()
    assert len(set(keys)) == 2 and all(k.startswith("dctl_ik_") and len(k) > 40 for k in keys)
    assert generation == 4  # the agent is told, and restarts its engines with the key


def test_unsupported_database_urls_are_named() -> None:
    from controlplane.db import DatabaseUrlError

    with pytest.raises(DatabaseUrlError, match="sqlite:///PATH or postgresql"):
        make_engine("mysql://root@localhost/x")


def test_upgrading_to_0006_keeps_hosts_labels_for_placement_and_as_reported(
    empty_url: str,
) -> None:
    migrate.upgrade(empty_url, "0005")
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO host (id, name, labels, state, draining, registered_at, "
                "heartbeat_interval_s, port_range_start, port_range_end, facts, gpu_samples, "
                "desired_generation, applied_generation, heartbeat_seq) VALUES (1, 'gpu-a', "
                "'{\"tier\": \"prod\"}', 'ready', false, '2026-01-01 00:00:00', 5, 18000, "
                "18099, '{}', '[]', 1, 0, 0)"
            )
        )
    engine.dispose()
    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT labels, reported_labels FROM host")).one()
    engine.dispose()
    # An upgrade moves no instance: the labels placement read stay the operator's.
    # SQLite hands JSON back as text, PostgreSQL as the decoded value.
    assert [json.loads(v) if isinstance(v, str) else v for v in row] == [{"tier": "prod"}] * 2


def test_upgrading_to_0007_moves_rollout_spec_into_typed_settings_and_progress(
    empty_url: str,
) -> None:
    from sqlmodel import Session, col, select

    from controlplane.models import Rollout
    from controlplane.rollouts.progress import Promotion
    from protocol.rollout_states import RestartStage, RolloutKind, RolloutState

    migrate.upgrade(empty_url, "0006")
    now = "2026-01-01 00:00:00"
    managed = {
        "managed": True, "policy": {"interval_s": 60.0, "failure_limit": 2}, "surge": 1,
        "interval_since": "2026-01-01T00:01:00+00:00", "step_since": "2026-01-01T00:00:30+00:00",
        "restarts_at": 3, "notified_state": RolloutState.PROGRESSING, "promote": "full",
    }  # fmt: skip
    restart = {"managed": True, "policy": {}, "queue": [7, 8], "done": [5], "current": 6,
               "stage": "stopping"}  # fmt: skip
    rows = [(1, "rollout", managed), (2, "rollout", {}), (3, "restart", restart)]
    engine = make_engine(empty_url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO model (id, name, created_at) VALUES (1, 'm', '{now}')"))
        for version in (1, 2):
            conn.execute(
                sa.text(
                    "INSERT INTO modelversion (id, model_id, version, line, digest, manifest, "
                    f"total_bytes, source_uri, notes, deprecated, created_at) VALUES ({version}, "
                    f"1, 'v{version}', 'base', '{str(version) * 64}', '[]', 0, '/w', '', false, "
                    f"'{now}')"
                )
            )
        conn.execute(
            sa.text(
                "INSERT INTO deployment (id, name, model_id, stable_version_id, engine_config, "
                "placement_hosts, placement_labels, instances_per_host, created_at, updated_at) "
                f"VALUES (1, 'web', 1, 1, '{{}}', '[]', '{{}}', 2, '{now}', '{now}')"
            )
        )
        for rollout_id, kind, spec in rows:
            conn.execute(
                sa.text(
                    "INSERT INTO rollout (id, deployment_id, from_version_id, to_version_id, "
                    "state, step_index, canary_weight, steps, analysis, message, created_at, "
                    f"updated_at, kind, spec) VALUES ({rollout_id}, 1, 1, 2, :state, 0, 0, "
                    f"'[]', '[]', '', '{now}', '{now}', '{kind}', :spec)"
                ),
                {"state": RolloutState.ABORTED.value, "spec": json.dumps(spec)},
            )
    engine.dispose()

    migrate.upgrade(empty_url)
    engine = make_engine(empty_url)
    with Session(engine) as session:
        got = session.exec(select(Rollout).order_by(col(Rollout.id))).all()
        assert [r.kind for r in got] == [RolloutKind.ROLLOUT, RolloutKind.MANUAL, "restart"]
        assert got[0].state == RolloutState.ABORTED
        settings, progress = got[0].settings, got[0].progress
        assert (settings.policy.interval_s, settings.policy.failure_limit) == (60.0, 2)
        assert (settings.surge, settings.all_at_once) == (1, False)
        assert progress.interval_since is not None and progress.step_since is not None
        assert (progress.interval_since - progress.step_since).total_seconds() == 30
        assert (progress.restarts_at, progress.pending) == (3, Promotion.FULL)
        assert progress.notified_state == RolloutState.PROGRESSING
        assert (got[1].settings.surge, got[1].progress.queue) == (0, ())
        restarting = got[2].progress
        assert (restarting.queue, restarting.done) == ((7, 8), (5,))
        assert (restarting.current, restarting.stage) == (6, RestartStage.STOPPING)
    engine.dispose()

    # And back: the bag as it was (a manual canary a rollout without `managed` again).
    migrate.downgrade(empty_url, "0006")
    engine = make_engine(empty_url)
    with engine.connect() as conn:
        back = conn.execute(sa.text("SELECT id, kind, spec FROM rollout ORDER BY id")).all()
    engine.dispose()
    assert [(i, k, json.loads(s) if isinstance(s, str) else s) for i, k, s in back] == rows
