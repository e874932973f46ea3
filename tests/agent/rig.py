"""An agent loop wired to an in-process control plane double (`FakeControlPlane`) and fake
engines: what the main-loop and log-shipping tests drive."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from agent.control_plane import DesiredState
from agent.errors import ControlPlaneRejected, ControlPlaneUnavailable
from agent.gpu import BackendSelection, FakeBackend
from agent.main_loop import Agent, AgentConfig
from agent.preflight import PreflightReport
from agent.snapshots import SnapshotStore
from agent.supervisor import Supervisor
from protocol.manifest import compute_manifest
from protocol.wire import (
    DesiredInstance,
    Heartbeat,
    MemoryPlan,
    ModelVersionRef,
    PreflightCheck,
    RegisterRequest,
    RegisterResponse,
)
from tests.agent.fakes import FakeLauncher, Health
from tests.clock import FakeClock

GIB = 1024**3


class FakeControlPlane:
    """Answers like the control plane; can be taken down or made to refuse the token."""

    url = "http://control-plane.test"

    def __init__(self) -> None:
        self.registrations: list[RegisterRequest] = []
        self.beats: list[Heartbeat] = []
        self.instances: list[DesiredInstance] = []
        self.down = False
        self.refuse_token: str | None = None
        self.generation = 1
        self.keep_digests: list[str] = []
        self.prefetch: list[ModelVersionRef] = []

    def register(self, request: RegisterRequest, bootstrap_token: str) -> RegisterResponse:
        if self.down:
            raise ControlPlaneUnavailable("connection refused")
        self.registrations.append(request)
        n = len(self.registrations)
        return RegisterResponse(
            host_id=1, host_name=request.name, agent_token=f"agent-token-{n}",
            heartbeat_interval_s=1.0,
        )  # fmt: skip

    def heartbeat(self, beat: Heartbeat, token: str) -> DesiredState:
        if self.down:
            raise ControlPlaneUnavailable("connection refused")
        if token == self.refuse_token:
            raise ControlPlaneRejected(401, "token revoked")
        self.beats.append(beat)
        return DesiredState(
            generation=self.generation, host_id=1, heartbeat_interval_s=1.0,
            server_time=datetime.now(UTC), instances=list(self.instances),
            keep_digests=list(self.keep_digests), prefetch=list(self.prefetch),
        )  # fmt: skip


def checkpoint(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(f'{{"seed": {seed}}}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * (seed + 1))
    return root


def desired(src: Path, version: str = "v1", plan: MemoryPlan | None = None) -> DesiredInstance:
    manifest = compute_manifest(src)
    return DesiredInstance(
        instance_id=5,
        deployment="demo",
        port=18005,
        model=ModelVersionRef(
            name="demo", version=version, digest=manifest.digest(), manifest=manifest,
            source_uri=str(src), memory_plan=plan,
        ),
    )  # fmt: skip


class Rig:
    def __init__(
        self,
        tmp_path: Path,
        preflight_ok: bool = True,
        token: str | None = "boot",
        selection: BackendSelection | None = None,
    ):
        self.tmp = tmp_path
        self.selection = selection or BackendSelection("fake", FakeBackend("2xH100"))
        self.scraped: list[tuple[str, int]] = []
        self.cp = FakeControlPlane()
        self.clock = FakeClock()
        self.launcher = FakeLauncher()
        self.health = Health()
        self.engine_text = ""
        status = "pass" if preflight_ok else "fail"
        self.preflight = PreflightReport(
            [PreflightCheck(name="ecc", status=status, reason="uncorrectable ECC errors")]
        )
        self.token = token
        self.agent = self.make_agent()

    def make_agent(self) -> Agent:
        supervisor = Supervisor(
            self.tmp / "data" / "agent" / "run", self.launcher, self.health,
            clock=self.clock.monotonic, engine_command=["engine-bin"],
        )  # fmt: skip
        return Agent(
            AgentConfig(control_plane=self.cp.url, data_dir=self.tmp / "data",
                        bootstrap_token=self.token, host_name="gpu-1",
                        advertise_address="10.1.2.3"),
            self.selection,
            self.preflight,
            SnapshotStore(self.tmp / "data" / "snapshots", model_roots=[self.tmp]),
            supervisor,
            self.cp,
            fetch_metrics=self.fetch_metrics,
            clock=self.clock.monotonic,
        )  # fmt: skip

    def fetch_metrics(self, host: str, port: int, path: str = "/metrics") -> str | None:
        self.scraped.append((host, port))
        return self.engine_text or None

    def settle(self) -> None:
        """Heartbeat, let the snapshot worker finish, and reconcile its result."""
        self.agent.heartbeat_once()
        deadline = time.monotonic() + 10
        while self.agent.fetcher.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
            self.agent.step()
        self.agent.supervisor.tick()

    def observed(self) -> dict[int, object]:
        return {o.instance_id: o for o in self.agent.observed()}
