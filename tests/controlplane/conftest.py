"""Fixtures: the API on a real SQLite file and on a throwaway PostgreSQL database."""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from controlplane import migrate
from controlplane.app import create_app
from controlplane.bootstrap import ensure_admin_token
from controlplane.db import make_engine
from controlplane.settings import ControlPlaneSettings
from tests.clock import FakeClock

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_ADMIN_URL = f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/postgres"
TABLES = ["logline", "requestrecord", "tokenuse",
          "lease", "trafficwindow", "metricsample", "rollout", "instance", "deployment",
          "apitoken", "gpu", "modelversion", "model", "event", "host", "lease",
          "gatewayprocess"]  # fmt: skip


def postgres_listening() -> bool:
    """True when something accepts TCP connections on 127.0.0.1:5432."""
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=0.5):
            return True
    except OSError:
        return False


def require_postgres() -> None:
    """Skip when no PostgreSQL listens, unless CI is set: then its absence is a failure."""
    if postgres_listening():
        return
    if os.environ.get("CI"):
        pytest.fail("CI is set but no PostgreSQL listens on 127.0.0.1:5432")
    pytest.skip("no PostgreSQL on 127.0.0.1:5432")


def create_pg_database() -> str:
    """Create a throwaway database; returns its URL."""
    name = f"dctl_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/{name}"


def drop_pg_database(url: str) -> None:
    """Drop a throwaway database (kicking out leftover connections)."""
    name = url.rsplit("/", 1)[1]
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated once; each test gets a copy."""
    path = tmp_path_factory.mktemp("template") / "dctl.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A throwaway PostgreSQL database migrated once for the session."""
    require_postgres()
    url = create_pg_database()
    migrate.upgrade(url)
    yield url
    drop_pg_database(url)


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path, sqlite_template: Path) -> str:
    """A migrated, empty database of each kind."""
    if request.param == "sqlite":
        path = tmp_path / "dctl.db"
        shutil.copy(sqlite_template, path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("pg_url")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
    engine.dispose()
    return url


@dataclass
class Api:
    """A running app with an admin token and helpers to make the others."""

    client: TestClient
    app: FastAPI
    engine: Engine
    clock: FakeClock
    admin: str
    settings: ControlPlaneSettings
    # The latest agent token `register` got for each host name.
    agent_tokens: dict[str, str] = field(default_factory=dict)
    # The generation of the last desired state each agent token got (`fleet.beat` reports it
    # applied at the next heartbeat, as an agent does).
    generations: dict[str, int] = field(default_factory=dict)

    def auth(self, secret: str) -> dict[str, str]:
        """Headers for a token."""
        return {"Authorization": f"Bearer {secret}"}

    def call(self, method: str, path: str, token: str | None, **kwargs: Any) -> Any:
        """One request with `token` (None: no Authorization header)."""
        headers = {**(self.auth(token) if token else {}), **kwargs.pop("headers", {})}
        return self.client.request(method, path, headers=headers, **kwargs)

    def as_admin(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request with the admin token."""
        return self.call(method, path, self.admin, **kwargs)

    def token(self, role: str, name: str | None = None, **extra: Any) -> str:
        """Mint a token of `role` with the admin token; returns its secret."""
        body = {"name": name or f"t-{role}-{uuid.uuid4().hex[:6]}", "role": role, **extra}
        response = self.as_admin("POST", "/api/v1/tokens", json=body)
        assert response.status_code == 201, response.text
        secret: str = response.json()["secret"]
        return secret

    def register(
        self, name: str, *, stamp: dict[str, str] | None = None, **body: Any
    ) -> dict[str, Any]:
        """Register an agent for host `name`: with a fresh bootstrap token the first time (one
        that stamps the operator's labels STAMP on it), then (as its agent would) with the
        host's current agent token. Labels in BODY are the agent's own: reported, not placed by."""
        token = self.agent_tokens.get(name) or self.token("bootstrap", labels=stamp)
        response = self.call("POST", "/api/v1/agents/register", token, json={"name": name, **body})
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        self.agent_tokens[name] = result["agent_token"]
        return result

    def heartbeat(self, agent_token: str, **body: Any) -> Any:
        """One heartbeat."""
        return self.call("POST", "/api/v1/agents/heartbeat", agent_token, json=body)


@pytest.fixture
def api(db_url: str) -> Iterator[Api]:
    """The control plane on a fresh database, with a fake clock and no background sweeps."""
    clock = FakeClock()
    engine = make_engine(db_url)
    admin = ensure_admin_token(engine, clock())
    assert admin is not None
    settings = ControlPlaneSettings(database_url=db_url)
    app = create_app(settings, clock=clock, engine=engine, run_controllers=False)
    with TestClient(app) as client:
        yield Api(
            client=client, app=app, engine=engine, clock=clock, admin=admin, settings=settings
        )
    engine.dispose()


@contextmanager
def statements(api: Api) -> Iterator[list[str]]:
    """Every SQL statement the app runs inside the block."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    sa.event.listen(api.engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(api.engine, "before_cursor_execute", record)


def sha(n: int) -> str:
    """A well-formed sha256 hex string."""
    return f"{n:064x}"


def manifest(*paths: str, seed: int = 1) -> dict[str, Any]:
    """A manifest body with one entry per path."""
    return {
        "files": [{"path": p, "size": 10 + i, "sha256": sha(seed + i)} for i, p in enumerate(paths)]
    }


def gpu(index: int, **extra: Any) -> dict[str, Any]:
    """A GPU status as an agent reports it."""
    return {
        "index": index,
        "uuid": f"GPU-{index:04d}",
        "name": "NVIDIA H200",
        "memory_total_bytes": 141 * 2**30,
        "memory_used_bytes": 2**30,
        "utilization_percent": 40.0,
        "temperature_c": 50.0,
        "power_w": 300.0,
        **extra,
    }


def register_version(
    api: Api, name: str = "demo", version: str = "v1", source: str = "/nonexistent", **extra: Any
) -> dict[str, Any]:
    """Register a model version with the admin token."""
    body = {"version": version, "manifest": manifest("config.json", "model.safetensors"),
            "source_uri": source, **extra}  # fmt: skip
    response = api.as_admin("POST", f"/api/v1/models/{name}/versions", json=body)
    assert response.status_code in (200, 201), response.text
    result: dict[str, Any] = response.json()
    return result


def deploy(api: Api, name: str, hosts: list[str], per_host: int = 1, **extra: Any) -> Any:
    """Create a deployment of demo:v1 on `hosts`."""
    body = {"name": name, "model": "demo", "version": "v1", "placement": {"hosts": hosts},
            "instances_per_host": per_host, **extra}  # fmt: skip
    return api.as_admin("POST", "/api/v1/deployments", json=body)
