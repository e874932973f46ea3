"""Two real `dctl server` processes on one PostgreSQL database: one runs the controllers, and
when it is killed (-9, no goodbye) the other takes over within two lease periods."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import sqlalchemy as sa

from client.credentials import CredentialsFile
from controlplane.db import make_engine
from tests.controlplane.conftest import create_pg_database, drop_pg_database, require_postgres

pytestmark = pytest.mark.slow

LEASE_S = 2.0
T = TypeVar("T")


@dataclass
class Server:
    """One `dctl server` process."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def metric(self, name: str) -> float | None:
        """This server's value of an unlabelled-or-single-series gauge on /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        return None if match is None else float(match.group(1))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 30.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            found = probe()
        except (httpx.HTTPError, sa.exc.SQLAlchemyError):
            found = None
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def database() -> Iterator[str]:
    require_postgres()
    url = create_pg_database()
    yield url
    drop_pg_database(url)


@pytest.fixture
def start(database: str, tmp_path: Path) -> Iterator[Callable[[bool], Server]]:
    """Start servers on `database` (the first one migrates it); all are stopped at the end."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(
        XDG_CONFIG_HOME=str(tmp_path / "config"),
        XDG_DATA_HOME=str(tmp_path / "data"),
        DCTL_LEASE_S=str(LEASE_S),
        DCTL_HEARTBEAT_INTERVAL_S="1",
    )
    started: list[Server] = []

    def start_one(migrate: bool) -> Server:
        port = free_port()
        log = tmp_path / f"server-{port}.log"
        argv = [sys.executable, "-m", "cli", "server", "--db", database, "--port", str(port)]
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                argv + (["--migrate"] if migrate else []), env=env, stdout=sink, stderr=sink
            )
        server = Server(proc, f"http://127.0.0.1:{port}", log)
        started.append(server)
        wait_for(
            "the server to be ready",
            lambda: httpx.get(f"{server.url}/readyz", timeout=1).status_code == 200,
            60,
        )
        return server

    yield start_one
    for server in started:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(20)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()


def test_the_other_replica_takes_over_the_controllers_after_kill_9(
    database: str, start: Callable[[bool], Server], tmp_path: Path
) -> None:
    first, second = start(True), start(False)
    engine = make_engine(database)

    def holder_pid() -> int | None:
        with engine.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT holder FROM lease WHERE name = 'controllers' AND expires_at > "
                    "CAST(now() AT TIME ZONE 'UTC' AS timestamp)"
                )
            ).first()
        return None if row is None else int(row.holder.split(":")[1])

    try:
        by_pid = {first.proc.pid: first, second.proc.pid: second}
        leader = by_pid[wait_for("a lease holder", holder_pid)]
        standby = second if leader is first else first
        wait_for("the leader's gauge", lambda: leader.metric("dctl_controller_leader") == 1.0)
        assert standby.metric("dctl_controller_leader") == 0.0

        leader.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        leader.proc.wait(10)
        wait_for("the standby to take the lease", lambda: holder_pid() == standby.proc.pid, 10)
        took_s = time.monotonic() - killed_at
        assert took_s < 2 * LEASE_S, f"took over after {took_s:.1f}s"
        assert standby.metric("dctl_controller_leader") == 1.0

        # The survivor really runs them: a host that never heartbeats goes not_ready (3 s).
        # Not a terminal: the first start saved the admin token only in the credentials file.
        _, contexts = CredentialsFile(tmp_path / "config" / "dctl" / "credentials").load()
        auth = {"Authorization": f"Bearer {contexts['default'].token}"}
        with httpx.Client(base_url=standby.url, headers=auth, timeout=10) as http:
            boot = http.post("/api/v1/tokens", json={"name": "boot", "role": "bootstrap"})
            secret = boot.json()["secret"]
            registered = http.post(
                "/api/v1/agents/register",
                json={"name": "silent"},
                headers={"Authorization": f"Bearer {secret}"},
            )
            assert registered.status_code == 200, registered.text
            wait_for(
                "the survivor's health sweep",
                lambda: http.get("/api/v1/hosts/silent").json()["state"] == "not_ready",
                15,
            )
    finally:
        engine.dispose()
