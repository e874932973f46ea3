"""`dctl doctor` against a real control plane (uvicorn on loopback, SQLite, an injected clock)
fed by real heartbeats: fake GPUs sampled by the agent's own code (a temperature fault among
them), preflight run by the agent against a torch built for a newer CUDA than the driver's, a
snapshot the agent's store refused for a corrupt file, and engine metrics from the engine's own
registry (429s from a tiny `max_queue`, queue depth, growing latency) turned into heartbeat
deltas by the agent's tracker — the path the doctor reads in production."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest

from agent.engine_metrics import EngineMetricsTracker
from agent.errors import SnapshotMismatch
from agent.gpu.fake import FakeBackend
from agent.gpu.select import BackendSelection
from agent.host_facts import gpu_status, host_facts
from agent.preflight import PreflightConfig, TorchInfo, run_preflight
from agent.snapshots import SnapshotStore
from controlplane import migrate
from controlplane.app import create_app
from controlplane.bootstrap import ensure_admin_token
from controlplane.db import make_engine
from controlplane.settings import ControlPlaneSettings
from engine.metrics import EngineMetrics
from protocol.manifest import compute_manifest
from protocol.wire import SnapshotFailure
from tests.cli.conftest import Dctl
from tests.clock import FakeClock
from tests.uvicorn_thread import serve_in_thread

GIB = 2**30


@dataclass
class FakeHost:
    """One agent's view: its fake GPUs, its engines' metrics, what it heartbeats."""

    name: str
    token: str
    gpus: FakeBackend
    facts: dict[str, Any] = field(default_factory=dict)
    engines: dict[int, EngineMetrics] = field(default_factory=dict)
    tracker: EngineMetricsTracker = field(default_factory=EngineMetricsTracker)
    states: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class Plane:
    """The control plane, its clock and an admin HTTP client."""

    url: str
    admin: str
    clock: FakeClock
    http: httpx.Client
    tmp: Path

    def post(self, path: str, body: dict[str, Any], token: str | None = None) -> Any:
        headers = {"Authorization": f"Bearer {token or self.admin}"}
        answer = self.http.post(path, json=body, headers=headers)
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    def add_host(self, name: str, gpus: str, faults: str = "", **facts: Any) -> FakeHost:
        boot = self.post("/api/v1/tokens", {"name": f"boot-{name}", "role": "bootstrap"})
        backend = FakeBackend(gpus)
        if faults:
            backend.inject(faults)
        reply = self.post("/api/v1/agents/register", {"name": name}, boot["secret"])
        return FakeHost(name, reply["agent_token"], backend, facts)

    def heartbeat(self, host: FakeHost) -> dict[str, Any]:
        """One heartbeat of HOST (GPUs sampled now, engines' metrics since the last one), then
        10 s pass, so every heartbeat lands in a bucket of its own."""
        sample = host.gpus.sample()
        facts = host_facts("fake", sample, [], self.tmp).model_dump(mode="json")
        for iid, engine in host.engines.items():
            host.tracker.record(iid, generate_latest(engine.registry).decode())
        body = {
            "facts": {**facts, **host.facts},
            "gpus": [g.model_dump(mode="json") for g in gpu_status(sample)],
            "instances": list(host.states.values()),
            "metrics": [m.model_dump(mode="json") for m in host.tracker.deltas()],
        }
        reply: dict[str, Any] = self.post("/api/v1/agents/heartbeat", body, host.token)
        host.tracker.acknowledge()
        self.clock.advance(10)
        return reply

    def deploy(self, host: FakeHost, name: str, version: str, **extra: Any) -> int:
        """Deployment NAME of demo:VERSION on HOST; its one instance reported ready."""
        body = {"name": name, "model": "demo", "version": version,
                "placement": {"hosts": [host.name]}, **extra}  # fmt: skip
        self.post("/api/v1/deployments", body)
        [desired] = self.heartbeat(host)["instances"]
        iid: int = desired["instance_id"]
        host.states[iid] = {"instance_id": iid, "state": "ready", "port": desired["port"],
                            "pid": 4000 + iid}  # fmt: skip
        host.engines[iid] = EngineMetrics()
        return iid


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    tmp = tmp_path_factory.mktemp("doctor")
    url = f"sqlite:///{tmp / 'dctl.db'}"
    migrate.upgrade(url)
    clock = FakeClock()
    engine = make_engine(url)
    admin = ensure_admin_token(engine, clock())
    assert admin is not None
    app = create_app(ControlPlaneSettings(database_url=url), clock=clock, engine=engine,
                     run_controllers=False)  # fmt: skip
    with serve_in_thread(app, log_level="warning") as base, httpx.Client(base_url=base) as http:
        yield Plane(base, admin, clock, http, tmp)
    engine.dispose()


@pytest.fixture(scope="module")
def dctl(plane: Plane) -> Dctl:
    return Dctl({"DCTL_URL": plane.url, "DCTL_TOKEN": plane.admin,
                 "XDG_CONFIG_HOME": str(plane.tmp / "config")})  # fmt: skip


def register(plane: Plane, version: str, source: Path, **extra: Any) -> None:
    manifest = compute_manifest(source).model_dump(mode="json")
    body = {"version": version, "manifest": manifest, "source_uri": str(source), **extra}
    plane.post("/api/v1/models/demo/versions", body)


@pytest.fixture(scope="module")
def fleet(plane: Plane) -> dict[str, Any]:
    """Four deployments, each on a host of its own, each with one thing wrong but `ok`."""
    src = plane.tmp / "src"
    (src / "shards").mkdir(parents=True)
    (src / "config.json").write_text('{"model_type": "demo"}')
    (src / "shards" / "model.safetensors").write_bytes(b"\x01" * 4096)
    register(plane, "v1", src)
    huge = {"weights_bytes": 200 * GIB, "kv_bytes_per_token": 2**20, "max_context_tokens": 4096}
    register(plane, "big", src, memory_plan=huge, notes="200 GiB of weights")

    ok = plane.add_host("h-ok", "2xH200")
    ok_id = plane.deploy(ok, "ok", "v1")

    # A corrupt copy of v1's weights: the agent's store refuses it, naming the file.
    broken_src = plane.tmp / "broken"
    (broken_src / "shards").mkdir(parents=True)
    (broken_src / "config.json").write_text('{"model_type": "demo"}')
    (broken_src / "shards" / "model.safetensors").write_bytes(b"\x01" * 4095 + b"\x02")
    manifest = compute_manifest(src)
    with pytest.raises(SnapshotMismatch) as refused:
        SnapshotStore(plane.tmp / "store", model_roots=[plane.tmp]).fetch(manifest, str(broken_src))
    failure = SnapshotFailure(digest=manifest.digest(), error=str(refused.value))
    corrupt = plane.add_host("h-corrupt", "2xH200",
                             snapshot_failures=[failure.model_dump(mode="json")])  # fmt: skip
    broken_id = plane.deploy(corrupt, "broken", "v1")
    corrupt.states[broken_id].update(state="failed", port=None, pid=None,
                                     message=f"snapshot not fetched: {refused.value}")  # fmt: skip

    # One 22 GiB L4 for 200 GiB of weights; its driver's CUDA is older than torch's.
    torch = TorchInfo(version="2.5.1", cuda="12.8", devices=1)
    small_gpus = FakeBackend("1xL4")
    report = run_preflight(BackendSelection("fake", small_gpus),
                           PreflightConfig(data_dir=plane.tmp), lambda: torch)  # fmt: skip
    small = plane.add_host(
        "h-small", "1xL4", preflight=[c.model_dump(mode="json") for c in report.checks]
    )
    plane.deploy(small, "huge", "big")

    # max_queue 2, 40 of 100 requests refused with 429, 2 waiting; GPU 1 at 91 °C; a game
    # day's 1.5 s of extra latency left on; latency growing 0.5 s -> 2 s.
    busy = plane.add_host("h-busy", "2xH200", faults="hot:1=91")
    config = {"service": {"max_queue": 2}, "chaos": {"extra_latency_ms": 1500}}
    busy_id = plane.deploy(busy, "busy", "v1", engine_config=config)
    for step in range(8):
        for iid, host in ((ok_id, ok), (busy_id, busy)):
            engine = host.engines[iid]
            engine.requests_finished.labels(finish_reason="stop").inc(10)
            for _ in range(10):
                engine.e2e_latency.observe(0.5 if iid == ok_id else 0.5 + 0.25 * step)
        for _ in range(2 if step < 7 else 1):
            busy.engines[busy_id].record_error("queue_full")
        # Denoising forwards of 5 ms and 60 ms in turn (erratic), 1.1 tokens per forward.
        step_s = 0.005 if step % 2 else 0.06
        for _ in range(5):
            busy.engines[busy_id].denoise_step.labels(block_size="32").observe(step_s)
            busy.engines[busy_id].tokens_per_forward.observe(1.1)
        busy.engines[busy_id].requests_waiting.set(2)
        for host in (ok, corrupt, small, busy):
            plane.heartbeat(host)
    for host in (ok, corrupt, small, busy):
        plane.heartbeat(host)  # closes the last bucket
    return {"busy": busy_id, "broken": broken_id, "ok": ok_id}


def test_a_healthy_deployment_has_no_findings(dctl: Dctl, fleet: dict[str, Any]) -> None:
    result = dctl("doctor", "ok")
    assert (result.code, result.stdout) == (0, "no findings\n")
    as_json = dctl("doctor", "ok", "--json")
    assert as_json.code == 0 and json.loads(as_json.stdout) == []


def test_a_corrupt_snapshot_is_a_load_failure(dctl: Dctl, fleet: dict[str, Any]) -> None:
    result = dctl("doctor", "broken", "--json")
    assert result.code == 1
    found = {f["rule"]: f for f in json.loads(result.stdout)}
    assert set(found) == {"load.snapshot", "load.instance"}
    assert found["load.snapshot"]["evidence"]["file"] == "shards/model.safetensors"
    assert found["load.snapshot"]["subject"] == "host/h-corrupt"
    assert found["load.instance"]["evidence"]["file"] == "shards/model.safetensors"
    assert found["load.instance"]["evidence"]["state"] == "failed"


def test_a_memory_plan_too_large_and_a_cuda_mismatch(dctl: Dctl, fleet: dict[str, Any]) -> None:
    result = dctl("doctor", "huge", "--json")
    assert result.code == 1
    found = {f["rule"]: f for f in json.loads(result.stdout)}
    plan = found["load.memory_plan"]
    # 200 GiB + 1 MiB of KV x 32 slots x 4096 tokens = 328 GiB; an L4 (22.5 GiB) x 0.85.
    assert plan["evidence"]["needed_gib"] == 328.0 and plan["evidence"]["available_gib"] == 19.1
    assert "INT8" in plan["fix"] and "expert parallelism" in plan["fix"]
    cuda = found["load.preflight"]
    assert cuda["evidence"]["check"] == "cuda_compat" and "12.4" in cuda["evidence"]["reason"]
    assert "driver/CUDA mismatch" in cuda["summary"]


def test_overflow_heat_chaos_jitter_and_creep(dctl: Dctl, fleet: dict[str, Any]) -> None:
    result = dctl("doctor", "--host", "h-busy", "--json")
    assert result.code == 1
    found = {f["rule"]: f for f in json.loads(result.stdout)}
    assert all("busy" in f["subject"] for f in found.values())  # nothing of the other hosts
    overflow = found["serving.queue_overflow"]
    # 15 refused (2 a bucket, 1 in the last) of 15 + 80 finished.
    assert overflow["severity"] == "error"
    assert overflow["evidence"]["rejected_429"] == 15 and overflow["evidence"]["requests"] == 95
    assert overflow["evidence"]["max_queue"] == 2
    assert found["serving.queue_full"]["evidence"] == {"queue_depth_peak": 2, "max_queue": 2}
    hot = found["hardware.gpu_hot"]
    assert hot["subject"] == "host/h-busy/gpu1" and hot["evidence"]["temperature_c"] == 91.0
    assert found["serving.chaos"]["evidence"]["extra_latency_ms"] == 1500
    jitter = found["hardware.step_jitter"]
    assert jitter["evidence"]["block_size"] == "32" and jitter["evidence"]["step_cv"] >= 0.5
    assert jitter["evidence"]["step_mean_ms"] == 32.5
    assert found["slow.decoding"]["evidence"]["tokens_per_forward"] == 1.1
    creep = found["degradation.uptime"]
    assert creep["evidence"]["ratio"] >= 1.5 and "dctl restart busy" in creep["fix"]


def test_text_output_and_the_whole_fleet(dctl: Dctl, fleet: dict[str, Any]) -> None:
    result = dctl("doctor")
    assert result.code == 1
    first = result.stdout.splitlines()[0]
    assert first.startswith("ERROR") and "evidence:" in result.stdout and "fix:" in result.stdout
    for subject in ("host/h-corrupt", "deployment/huge", "deployment/busy", "host/h-busy/gpu1"):
        assert subject in result.stdout


def test_unknown_names_are_usage_errors(dctl: Dctl, fleet: dict[str, Any]) -> None:
    missing = dctl("doctor", "no-such-deployment")
    assert missing.code == 2 and "deployment 'no-such-deployment' not found" in missing.stderr
    assert dctl("doctor", "--host", "no-such-host").code == 2
