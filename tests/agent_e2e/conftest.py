"""One real stack for the whole module: `dctl server` (SQLite), `dctl agent` (fake GPUs) and the
engine it launches on the tiny demo checkpoint, all on loopback, in a throwaway home."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from client.credentials import CredentialsFile
from client.http import ClientError, ControlPlaneClient
from protocol.rest import DeploymentCreate, InstanceOut, Placement, TokenCreate

T = TypeVar("T")
HOST = "e2e-host"
DCTL = [sys.executable, "-m", "cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_range(count: int = 4) -> tuple[int, int]:
    for _ in range(100):
        first = free_port()
        ok = True
        for port in range(first, first + count):
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
        if ok:
            return first, first + count - 1
    raise RuntimeError("no free port range")


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 90.0) -> T:
    """Poll PROBE until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except ClientError:
            last = None
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@dataclass
class Stack:
    """Handles on the running stack."""

    home: Path
    env: dict[str, str]
    url: str
    token: str
    api: ControlPlaneClient
    agent_args: list[str]
    logs: Path
    server: subprocess.Popen[bytes] | None = None
    agent: subprocess.Popen[bytes] | None = None
    server_port: int = 0
    checkpoints: dict[str, Path] = field(default_factory=dict)

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("ab")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def start_server(self, migrate: bool = False) -> None:
        argv = [*DCTL, "server", "--port", str(self.server_port)]
        self.server = self.spawn("server", argv + (["--migrate"] if migrate else []), self.env)
        wait_for("the control plane", lambda: self.api.request("GET", "/readyz"), 60)

    def stop_server(self) -> None:
        assert self.server is not None
        self.server.send_signal(signal.SIGTERM)
        self.server.wait(timeout=30)

    def start_agent(self) -> None:
        self.agent = self.spawn("agent", [*DCTL, "agent", *self.agent_args], self.env)

    def stop_agent(self) -> None:
        assert self.agent is not None
        self.agent.send_signal(signal.SIGTERM)
        self.agent.wait(timeout=30)

    def dctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**self.env, "DCTL_URL": self.url, "DCTL_TOKEN": self.token}
        return subprocess.run([*DCTL, *args], capture_output=True, text=True, env=env, check=True)

    def instance(self) -> InstanceOut:
        [inst] = self.api.get_deployment("demo").instances
        return inst

    def ready_instance(self, timeout_s: float = 300.0, **want: object) -> InstanceOut:
        def probe() -> InstanceOut | None:
            inst = self.instance()
            if inst.observed_state != "ready":
                return None
            return inst if all(getattr(inst, k) == v for k, v in want.items()) else None

        try:
            return wait_for(f"instance ready with {want}", probe, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.diagnostics()}") from None

    def diagnostics(self) -> str:
        """The last lines of every log, for a failure message (tmp dirs do not outlive runs)."""
        logs = [*sorted(self.logs.glob("*.log")),
                *sorted((self.agent_data() / "agent" / "run" / "logs").glob("*.log"))]  # fmt: skip
        parts = []
        for log in logs:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name}\n" + "\n".join(line[:300] for line in tail))
        return "\n".join(parts)

    def agent_data(self) -> Path:
        return self.home / "agent-data"


def _isolated_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
        DCTL_DATA_DIR=str(home / "cp"),
        DCTL_HEARTBEAT_INTERVAL_S="1",
        # test_secrets_in_logs plants a rollout webhook whose receiver listens on loopback.
        DCTL_NOTIFY_ALLOW_PRIVATE="true",
    )
    return env


def boot_stack(home: Path, host: str) -> Stack:
    """A control plane started in HOME (its admin token read back) and the arguments of an agent
    for HOST with two fake GPUs; the agent is not started."""
    env = _isolated_env(home)
    logs = home / "logs"
    logs.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    boot = Stack(home, env, url, "", ControlPlaneClient(url), [], logs, server_port=port)
    boot.start_server(migrate=True)
    _, contexts = CredentialsFile(home / "config" / "dctl" / "credentials").load()
    token = contexts["default"].token
    assert token
    api = ControlPlaneClient(url, token)
    first, last = free_range()
    # The checkpoints the tests register are under HOME: the agent copies them from disk.
    agent_args = ["--control-plane", url, "--data-dir", str(home / "agent-data"),
                  "--name", host, "--ports", f"{first}-{last}", "--gpu-backend", "fake",
                  "--fake-gpus", "2xH200", "--metrics-port", "0", "--startup-grace-s", "120",
                  "--allow-root", "--model-root", str(home)]  # fmt: skip
    return Stack(home, env, url, token, api, agent_args, logs, boot.server, server_port=port)


def stop_stack(stack: Stack) -> None:
    """Stop the agent and the control plane, then the engines the agent leaves running."""
    for proc in (stack.agent, stack.server):
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    # The agent leaves engines running on exit (so a restart adopts them): stop them here, each
    # with its process group (it leads one): a command engine's server is its wrapper's child,
    # and would outlive the wrapper alone.
    for pid_file in (stack.agent_data() / "agent" / "run").glob("instance-*.json"):
        pid = json.loads(pid_file.read_text())["pid"]
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError):
                kill(pid, signal.SIGKILL)
    stack.api.close()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    home = tmp_path_factory.mktemp("stack")
    s = boot_stack(home, HOST)
    api, env = s.api, s.env
    for version, seed in (("v1", "0"), ("v2", "1")):
        path = home / f"ckpt-{version}"
        s.dctl("model", "create-demo", str(path), "--random", "--seed", seed)
        s.checkpoints[version] = path
    s.dctl("model", "register", "demo:v1", str(s.checkpoints["v1"]))
    bootstrap = api.create_token(TokenCreate(name="e2e-boot", role="bootstrap", uses=1)).secret
    s.env = {**env, "DCTL_BOOTSTRAP_TOKEN": bootstrap}
    s.start_agent()
    wait_for("the host to register", lambda: api.get_host(HOST), 120)
    api.create_deployment(
        DeploymentCreate(name="demo", model="demo", version="v1", placement=Placement(hosts=[HOST]))
    )
    try:
        yield s
    finally:
        stop_stack(s)
