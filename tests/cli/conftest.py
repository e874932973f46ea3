"""A real `dctl server` process on a free loopback port with a real SQLite file, shared by the
CLI tests of a session; the CLI itself runs in-process (typer's runner) or as a subprocess."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from tests.cli.canned_api import CannedApi

DCTL = [sys.executable, "-m", "cli"]


def free_port() -> int:
    """A TCP port nobody listens on right now (the server binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def isolated_env(home: Path) -> dict[str, str]:
    """Environment with config, data and credentials under HOME, no DCTL_* leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
        DCTL_LOG_LEVEL="warning",
    )
    return env


def wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Poll /healthz until it answers 200; fail early with the server's output if it died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"dctl server exited {proc.returncode}: {out}\n{err}")
        try:
            if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"dctl server at {url} not healthy after {timeout} s")


@dataclass
class Server:
    """A running `dctl server`: where it listens, its database, its first output lines."""

    url: str
    db_url: str
    db_path: Path
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen[str]
    stdout_path: Path
    admin_token: str = ""
    lines: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """Stop the server and wait for it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(home: Path, *extra: str, migrate: bool = True) -> Server:
    """`dctl server [--migrate]` on a SQLite file under HOME (fresh on the first call)."""
    home.mkdir(parents=True, exist_ok=True)
    env = isolated_env(home)
    db_path = home / "dctl.db"
    db_url = f"sqlite:///{db_path}"
    port = free_port()
    stdout_path = home / "server.out"
    out = stdout_path.open("w")
    proc = subprocess.Popen(
        [*DCTL, "server", "--db", db_url, "--port", str(port), *extra]
        + (["--migrate"] if migrate else []),
        env=env,
        stdout=out,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = Server(f"http://127.0.0.1:{port}", db_url, db_path, home, env, proc, stdout_path)
    wait_healthy(server.url, proc)
    server.lines = stdout_path.read_text().splitlines()
    server.admin_token = saved_admin_token(server)
    return server


def saved_admin_token(server: Server) -> str:
    """The first admin token, from the credentials file: stdout here is not a terminal, so the
    server names the context it saved it as instead of printing it ("" after a restart)."""
    from client.credentials import CredentialsFile

    for line in server.lines:
        match = re.search(
            r"first admin token created and saved only in (\S+) .*as context '([^']+)'", line
        )
        if match:
            _, contexts = CredentialsFile(Path(match.group(1))).load()
            return contexts[match.group(2)].token or ""
    return ""


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One control plane for the whole CLI test session."""
    running = start_server(tmp_path_factory.mktemp("cp"))
    try:
        yield running
    finally:
        running.stop()


@dataclass
class Result:
    """What one CLI invocation did."""

    code: int
    stdout: str
    stderr: str


class Dctl:
    """Runs `dctl` against a server with that server's credentials file (in-process, fast)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.runner = CliRunner()

    def __call__(self, *args: str, env: dict[str, str] | None = None, input: str = "") -> Result:
        from cli.app import app

        merged = {**self.env, **(env or {})}
        # The runner patches os.environ with these; unset DCTL_* from the outer environment.
        overrides: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DCTL_")}
        overrides.update(merged)
        result = self.runner.invoke(app, list(args), env=overrides, input=input)
        if result.exception and not isinstance(result.exception, SystemExit):
            raise result.exception
        return Result(result.exit_code, result.stdout, result.stderr)


@pytest.fixture(scope="session")
def dctl(server: Server) -> Dctl:
    """The CLI as the admin who started the server (the credentials file it wrote)."""
    return Dctl({"XDG_CONFIG_HOME": server.env["XDG_CONFIG_HOME"]})


def run_dctl(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`dctl ARGS` as a real subprocess (for exit codes and output exactly as a shell sees)."""
    return subprocess.run([*DCTL, *args], env=env, capture_output=True, text=True, timeout=timeout)


# --- `dctl` against a loopback control plane with canned answers (tests.cli.canned_api) -------


@pytest.fixture
def canned() -> Iterator[CannedApi]:
    """A loopback control plane answering what each test tells it to."""
    api = CannedApi()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def run(tmp_path: Path, canned: CannedApi) -> Dctl:
    """`dctl` pointed at the canned API with no credentials file of its own."""
    return Dctl({"XDG_CONFIG_HOME": str(tmp_path), "DCTL_URL": canned.url, "DCTL_TOKEN": "t"})


@pytest.fixture
def offline(tmp_path: Path) -> Dctl:
    """`dctl` with nowhere to connect: for what must fail before any request."""
    return Dctl({"XDG_CONFIG_HOME": str(tmp_path), "DCTL_URL": "http://127.0.0.1:9"})
