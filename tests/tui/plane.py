"""A real control plane for the TUI tests: the controlplane app on a SQLite file, served by a
real uvicorn on a fixed loopback port, controllers running on the real clock, fake agents
heartbeating (see `tests.tui.fleet`). `stop()` and `start()` take the HTTP server away and
bring it back on the same port and database, as an operator restarting it would.

Seeded (`seed()`), and restored by `reseed()`:
- hosts `gpu-1` and `gpu-2` ready, 2 GPUs each with util / memory / temperature / power
  samples; `gpu-2`'s driver does not report power (`power_w` None: the TUI shows N/A);
  `gpu-3` registered but silent for hours: `not_ready`;
- model `demo`: `v1` (base), `v2` (diffusion, parent v1), `v3` (finetune, parent v2);
- deployment `web` of demo:v1, one instance on each of gpu-1 and gpu-2, reported ready;
- an active rollout of `web` to demo:v2, steps 10,50,100, held at step 1 (interval 1 h);
- events of all that (registrations, deployment, rollout started, gpu-3 not ready), and a
  gateway's traffic reports of `web` every couple of seconds.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import uvicorn
from sqlmodel import col

from client import AsyncControlPlaneClient, ControlPlaneClient, calls
from controlplane import migrate
from controlplane.app import create_app
from controlplane.bootstrap import ensure_admin_token
from controlplane.db import make_engine
from controlplane.models import Host
from controlplane.settings import ControlPlaneSettings
from protocol.rest import DeploymentCreate, DeploymentUpdate, Placement, TokenCreate
from protocol.rollout_policy import RolloutPolicy
from protocol.rollout_states import ACTIVE_STATES, RolloutPhase, RolloutState
from protocol.rollouts import RolloutAction, RolloutCreate
from protocol.wire import Manifest, MemoryPlan
from tests.tui.fleet import GIB, FakeAgent, Ticker

LINES = (("v1", "base", None), ("v2", "diffusion", "demo:v1"), ("v3", "finetune", "demo:v2"))
SEED_ROLLOUT = RolloutCreate(
    to="v2", steps=[10, 50, 100], policy=RolloutPolicy(interval_s=3600), reason="seeded"
)
ACTIVE = ACTIVE_STATES


def manifest(seed: int) -> Manifest:
    """A snapshot of two files; SEED makes the digest differ per version."""
    files = [("config.json", 100), ("model.safetensors", 16 * GIB)]
    entries = [
        {"path": path, "size": size, "sha256": f"{seed * 10 + i:064x}"}
        for i, (path, size) in enumerate(files)
    ]
    return Manifest.model_validate({"files": entries})


class Server:
    """uvicorn serving one app at a time on a port that stays the same across restarts."""

    def __init__(self) -> None:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = int(probe.getsockname()[1])
        probe.close()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    def start(self, app: Any) -> None:
        """Serve APP; returns once uvicorn accepts connections."""
        sock = socket.socket()
        # The previous server's connections may linger in TIME_WAIT on this port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        self._server, self._thread, self._socket = server, thread, sock

    @property
    def running(self) -> bool:
        """True while a server is up."""
        return self._server is not None

    def stop(self) -> None:
        """Stop serving (lifespan shutdown included); connections are refused until `start`."""
        if self._server is None or self._thread is None or self._socket is None:
            return
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()
        self._server = self._thread = self._socket = None


class Plane:
    """The running control plane and its handles; see the module docstring for what is seeded."""

    def __init__(self, data_dir: Path) -> None:
        self.db_url = f"sqlite:///{data_dir / 'dctl.db'}"
        migrate.upgrade(self.db_url)
        self.engine = make_engine(self.db_url)
        admin = ensure_admin_token(self.engine)
        assert admin is not None
        self.admin_token = admin
        # Heartbeats twice a second are faster than agents send them: allow them.
        self.settings = ControlPlaneSettings(
            database_url=self.db_url, data_dir=data_dir, lease_s=1.0,
            heartbeat_max_per_interval=50.0,
        )  # fmt: skip
        self.server = Server()
        self.url = f"http://127.0.0.1:{self.server.port}"
        self.sync = ControlPlaneClient(self.url, admin)
        self.viewer_token = ""
        self.operator_token = ""
        self.ticker: Ticker | None = None
        self.start()

    # --- the server --------------------------------------------------------------------------

    def start(self) -> None:
        """Serve a fresh app on the same port and database (controllers on the real clock)."""
        self.server.start(create_app(self.settings, engine=self.engine))

    def stop(self) -> None:
        """Stop the HTTP server: every request is refused until `start()`."""
        self.server.stop()

    def start_if_stopped(self) -> None:
        """Start the server again if a test left it stopped."""
        if not self.server.running:
            self.start()

    def close(self) -> None:
        """Stop agents and server; release the database."""
        if self.ticker is not None:
            self.ticker.stop()
        self.stop()
        self.sync.close()
        self.engine.dispose()

    def client(self, token: str | None = None) -> AsyncControlPlaneClient:
        """An async client as the TUI gets it: admin unless TOKEN says otherwise."""
        return AsyncControlPlaneClient(self.url, token or self.admin_token)

    # --- seeding -----------------------------------------------------------------------------

    def _token(self, name: str, role: str, **extra: Any) -> str:
        spec = TokenCreate.model_validate({"name": name, "role": role, **extra})
        return self.sync.create_token(spec).secret

    def _register(self, name: str, snapshots: list[str], **agent: Any) -> FakeAgent:
        # The operator's labels come with the bootstrap token (an agent's own are only reported).
        secret = self._token(f"boot-{name}", "bootstrap", uses=1, labels={"zone": "a"})
        body = {
            "name": name,
            "advertise_address": "127.0.0.1",
            "labels": {"zone": "a", "gpu": "h9"},
        }
        with ControlPlaneClient(self.url, secret) as boot:
            reply = boot.send(calls.request("POST", "/api/v1/agents/register", json=body))
        return FakeAgent(name, ControlPlaneClient(self.url, reply["agent_token"]), snapshots,
                         **agent)  # fmt: skip

    def seed(self) -> None:
        """Everything the module docstring lists, then the fake agents' heartbeats."""
        self.viewer_token = self._token("tui-viewer", "viewer")
        self.operator_token = self._token("tui-operator", "operator")
        digests = []
        for seed, (version, line, parent) in enumerate(LINES, start=1):
            made = manifest(seed)
            plan = MemoryPlan(weights_bytes=16 * GIB, kv_bytes_per_token=128 * 1024,
                              max_context_tokens=8192, num_parameters=8_000_000_000)  # fmt: skip
            self.sync.register_version("demo", version, made, source_uri=f"/models/demo-{version}",
                                       line=line, parent=parent, memory_plan=plan)  # fmt: skip
            digests.append(made.digest())
        agents = [
            self._register("gpu-1", digests),
            self._register("gpu-2", digests, unsupported=("power_w",)),
        ]
        silent = self._register("gpu-3", [])
        silent.client.close()
        self._silence("gpu-3")
        gateway = ControlPlaneClient(self.url, self._token("tui-gateway", "gateway"))
        self.ticker = Ticker(agents, gateway)
        self.ticker.tick()
        self.sync.create_deployment(DeploymentCreate(
            name="web", model="demo", version="v1", instances_per_host=1, gpus_per_instance=1,
            placement=Placement(hosts=["gpu-1", "gpu-2"]),
        ))  # fmt: skip
        self.ticker.start()
        self.wait_for("web ready on v1", lambda: self._web_on("v1"))
        self.wait_for("gpu-3 not ready", lambda: self.sync.get_host("gpu-3").state == "not_ready")
        self._start_rollout()

    def _silence(self, host: str) -> None:
        # A host whose agent went quiet hours ago and beats every hour: the health sweep marks
        # it not_ready (and, with so long an interval, never unreachable during a session).
        long_ago = datetime.now(UTC) - timedelta(hours=4)
        with self.engine.begin() as conn:
            conn.execute(
                sa.update(Host)
                .where(col(Host.name) == host)
                .values(last_seen_at=long_ago, registered_at=long_ago, heartbeat_interval_s=3600)
            )

    def _web_on(self, version: str) -> bool:
        web = self.sync.get_deployment("web")
        return len(web.instances) == 2 and all(
            i.version == version and i.observed_state == "ready" and i.on_version
            for i in web.instances
        )

    def _start_rollout(self) -> None:
        self.sync.start_rollout("web", SEED_ROLLOUT)

        def at_step_one() -> bool:
            out = self.sync.get_rollout("web")
            return (out.state, out.step, out.phase) == (
                RolloutState.PROGRESSING,
                1,
                RolloutPhase.ANALYSING,
            )

        self.wait_for("the seeded rollout at step 1", at_step_one)

    def reseed(self) -> None:
        """Back to the seeded state: hosts undrained, web on v1, a fresh rollout at step 1."""
        for name in ("gpu-1", "gpu-2"):
            if self.sync.get_host(name).draining:
                self.sync.undrain_host(name)
        current = self.sync.get_rollout("web")
        if current.state in ACTIVE:
            self.sync.rollout_action("web", "abort", RolloutAction(reason="reseed"))
        if self.sync.get_deployment("web").version != "v1":
            self.sync.update_deployment("web", DeploymentUpdate(version="v1"))
        self.wait_for("web ready on v1", lambda: self._web_on("v1"))
        self._start_rollout()

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
        """Poll CHECK (nudging the agents) until it holds; fail naming WHAT after TIMEOUT."""
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            if self.ticker is not None:
                self.ticker.nudge()
            time.sleep(0.1)
