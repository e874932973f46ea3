"""The agent loop against an in-process control plane: registration, reconcile, outages."""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, generate_latest

from agent.errors import ControlPlaneRejected
from agent.gpu import BackendSelection, EngineLoadSource, GpuSnapshot
from agent.preflight import PreflightReport
from protocol.wire import (
    InstanceState,
    MemoryPlan,
    PreflightCheck,
)
from tests.agent.rig import GIB, Rig, checkpoint, desired


def test_registers_once_and_keeps_the_token_private(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    identity = rig.agent.ensure_registered()
    assert identity is not None and identity.token == "agent-token-1"
    token_file = tmp_path / "data" / "agent" / "agent-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert rig.cp.registrations[0].facts is not None
    assert rig.cp.registrations[0].facts.gpu_backend == "fake"
    again = rig.make_agent()
    assert again.ensure_registered() == identity
    assert len(rig.cp.registrations) == 1


def test_without_identity_or_bootstrap_token_the_error_says_what_to_do(tmp_path: Path) -> None:
    rig = Rig(tmp_path, token=None)
    with pytest.raises(ControlPlaneRejected, match="--bootstrap-token"):
        rig.agent.ensure_registered()


def test_a_refused_token_triggers_a_new_registration(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agent.heartbeat_once()
    rig.cp.refuse_token = "agent-token-1"
    assert rig.agent.heartbeat_once() is None
    assert rig.agent.heartbeat_once() is not None
    assert len(rig.cp.registrations) == 2
    assert rig.cp.beats[-1].facts.gpu_backend == "fake"


def test_desired_instance_is_fetched_started_and_reported(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    want = desired(checkpoint(tmp_path / "v1", 1))
    rig.cp.instances = [want]
    rig.settle()
    assert len(rig.launcher.launched) == 1
    snapshot = tmp_path / "data" / "snapshots" / "snapshots" / want.model.digest
    assert snapshot.is_dir()
    assert rig.agent.supervisor.spec_of(5).snapshot_path == str(snapshot)  # type: ignore[union-attr]
    rig.health.ready = True
    rig.clock.advance(5)
    rig.agent.supervisor.tick()
    beat = rig.agent.heartbeat_once()
    assert beat is not None
    last = rig.cp.beats[-1]
    assert [(o.instance_id, o.state) for o in last.instances] == [(5, InstanceState.READY)]
    assert last.applied_generation == 1
    assert {s.state for s in rig.cp.beats[-2].snapshots} == {"ready"}
    assert [g.name for g in last.gpus] == ["NVIDIA H100 80GB HBM3"] * 2


def test_failed_preflight_starts_nothing_and_says_why(tmp_path: Path) -> None:
    rig = Rig(tmp_path, preflight_ok=False)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    rig.agent.heartbeat_once()
    assert rig.launcher.launched == []
    [observed] = rig.cp.beats[-1].instances
    assert observed.state == InstanceState.FAILED
    assert "preflight failed: ecc" in observed.message
    assert not rig.cp.beats[-1].facts.preflight_ok()


def test_a_host_without_a_usable_torch_still_starts_engines_that_bring_their_own(
    tmp_path: Path,
) -> None:
    # The agent's torch is the dctl engine's: vLLM in its own venv, or any command, needs none.
    rig = Rig(tmp_path)
    rig.preflight = PreflightReport(
        [PreflightCheck(name="torch", status="fail", reason="torch cannot be imported")]
    )
    rig.agent = rig.make_agent()
    command = desired(checkpoint(tmp_path / "v1", 1)).model_copy(
        update={"engine_config": {"engine": {"kind": "command",
                                             "command": [sys.executable, "{host}", "{port}"]}}}
    )  # fmt: skip
    rig.cp.instances = [command]
    rig.settle()
    assert len(rig.launcher.launched) == 1
    assert rig.launcher.launched[0][0][-3:-2] == ["agent.backends.fronted"]
    # The same host refuses a dctl engine, naming the check.
    rig.cp.instances = [desired(checkpoint(tmp_path / "v2", 2)).model_copy(
        update={"instance_id": 6, "port": 18006})]  # fmt: skip
    rig.cp.generation = 2
    rig.settle()
    rig.agent.heartbeat_once()
    observed = {o.instance_id: o for o in rig.cp.beats[-1].instances}
    assert observed[6].state == InstanceState.FAILED
    assert "preflight failed: torch" in observed[6].message


def test_a_corrupt_new_version_is_refused_and_the_old_engine_keeps_serving(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    rig.health.ready = True
    rig.clock.advance(5)
    rig.agent.supervisor.tick()
    src = checkpoint(tmp_path / "v2", 2)
    v2 = desired(src, "v2")
    (src / "model.safetensors").write_bytes(b"tampered after registration")
    rig.cp.instances = [v2]
    rig.cp.generation = 2
    rig.settle()
    rig.agent.heartbeat_once()
    [observed] = rig.cp.beats[-1].instances
    assert observed.state == InstanceState.READY
    assert "model.safetensors does not match the manifest" in observed.message
    assert len(rig.launcher.launched) == 1
    refused = [s for s in rig.cp.beats[-1].snapshots if s.digest == v2.model.digest]
    assert refused[0].state == "failed"
    assert rig.agent.metrics.snapshot_fetches.labels(result="mismatch")._value.get() == 1


def test_an_instance_that_does_not_fit_the_gpus_is_not_started(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    huge = MemoryPlan(weights_bytes=400 * GIB, kv_bytes_per_token=0)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1), plan=huge)]
    rig.settle()
    rig.settle()
    assert rig.launcher.launched == []
    [observed] = rig.agent.observed()
    # Its two GPUs run a rank each, holding half the weights.
    assert observed.state == InstanceState.FAILED
    assert "needs 200.0 GiB (on each of 2 GPUs, a rank's share of the weights" in observed.message


def test_outage_keeps_engines_and_the_next_heartbeat_carries_every_delta(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    rig.health.ready = True
    rig.clock.advance(5)
    rig.agent.supervisor.tick()
    registry = CollectorRegistry()
    tokens = Counter("dllm_generated_tokens", "t", registry=registry)
    tokens.inc(10)
    rig.engine_text = generate_latest(registry).decode()
    rig.agent.heartbeat_once()
    rig.cp.down = True
    for _ in range(3):
        tokens.inc(5)
        rig.engine_text = generate_latest(registry).decode()
        assert rig.agent.heartbeat_once() is None
        rig.clock.advance(1)
        rig.agent.supervisor.tick()
    assert rig.agent.supervisor.state_of(5) == InstanceState.READY
    assert rig.launcher.last.signals == []
    rig.cp.down = False
    rig.agent.heartbeat_once()
    [delta] = rig.cp.beats[-1].metrics
    assert delta.counters["dllm_generated_tokens_total"] == 15


def test_an_instance_no_longer_desired_is_stopped(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    proc = rig.launcher.last
    rig.cp.instances = []
    rig.agent.heartbeat_once()
    rig.agent.supervisor.tick()
    assert proc.signals and rig.agent.supervisor.instance_ids() == []


def test_snapshots_on_the_keep_list_outlive_pruning(tmp_path: Path) -> None:
    # The control plane keeps a rollback target on the list: the host must still hold it when
    # newer versions have pushed it out of the last-N window.
    rig = Rig(tmp_path)
    rig.agent.store.keep = 1
    first = desired(checkpoint(tmp_path / "v1", 1))
    rig.cp.instances = [first]
    rig.settle()
    rig.cp.keep_digests = [first.model.digest]
    for seed in (2, 3):
        rig.cp.instances = [desired(checkpoint(tmp_path / f"v{seed}", seed), version=f"v{seed}")]
        rig.cp.generation += 1
        rig.settle()
    held = set(rig.agent.store.digests())
    assert first.model.digest in held
    assert len(held) == 2  # the kept one and the one running: v2 was pruned
    rig.cp.keep_digests = []
    rig.cp.generation += 1
    rig.settle()
    assert first.model.digest not in rig.agent.store.digests()


def test_a_prefetched_snapshot_is_fetched_verified_and_reported_without_running(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    good = desired(checkpoint(tmp_path / "v2", 2), version="v2").model
    bad_src = checkpoint(tmp_path / "v3", 3)
    bad = desired(bad_src, version="v3").model
    (bad_src / "model.safetensors").write_bytes(b"tampered")  # no longer what the manifest says
    rig.cp.prefetch = [good, bad]
    rig.settle()
    rig.settle()
    assert rig.agent.store.has(good.digest) and not rig.agent.store.has(bad.digest)
    assert rig.launcher.launched == []  # fetched ahead of time, run by nothing
    facts = rig.cp.beats[-1].facts
    assert good.digest in facts.snapshots
    [failure] = facts.snapshot_failures
    assert failure.digest == bad.digest and "model.safetensors" in failure.error


def test_the_advertise_address_goes_with_registration_and_every_heartbeat(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.agent.heartbeat_once()
    rig.agent.heartbeat_once()
    assert rig.cp.registrations[0].advertise_address == "10.1.2.3"
    assert [b.advertise_address for b in rig.cp.beats] == ["10.1.2.3", "10.1.2.3"]


def test_the_engine_binds_the_given_address_with_its_key_on_its_gpus(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    want = desired(checkpoint(tmp_path / "v1", 1)).model_copy(
        update={"bind_address": "10.1.2.3", "api_key": "sk-secret", "gpu_indices": [1]}
    )
    rig.cp.instances = [want]
    rig.settle()
    [(argv, env, _)] = rig.launcher.launched
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and "sk-secret" not in " ".join(argv)
    config = yaml.safe_load(rig.agent.supervisor.config_path(5).read_text())
    assert config["service"] == {"host": "10.1.2.3", "port": 18005, "api_key": "sk-secret"}
    assert config["resources"]["device"] == "cpu"  # the fake backend's hosts serve on CPU
    rig.health.ready = True
    rig.clock.advance(5)
    rig.agent.supervisor.tick()
    rig.agent.heartbeat_once()
    assert rig.health.calls[-1][:2] == ("10.1.2.3", 18005)
    assert rig.scraped == [("10.1.2.3", 18005)]


def on_cores(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    """Make this a host of CORES cores, seen through its affinity mask or the machine's count."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)


def threads_of(rig: Rig, instance_id: int) -> int | None:
    """The CPU threads an instance's generated engine config gives it."""
    config = yaml.safe_load(rig.agent.supervisor.config_path(instance_id).read_text())
    threads: int | None = config["resources"].get("threads")
    return threads


def test_two_engines_on_a_2_core_host_get_one_thread_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_cores(monkeypatch, 2)
    rig = Rig(tmp_path)
    first = desired(checkpoint(tmp_path / "v1", 1))
    rig.cp.instances = [first, first.model_copy(update={"instance_id": 6, "port": 18006})]
    rig.settle()
    assert len(rig.launcher.launched) == 2
    assert (threads_of(rig, 5), threads_of(rig, 6)) == (1, 1)
    # The launch message (and log line) says what the agent chose.
    message = rig.observed()[5].message  # type: ignore[attr-defined]
    assert message.endswith(", 1 CPU thread (agent default: the host's cores / its instances)")


def test_threads_set_by_the_engine_config_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_cores(monkeypatch, 2)
    rig = Rig(tmp_path)
    first = desired(checkpoint(tmp_path / "v1", 1))
    pinned = first.model_copy(
        update={"instance_id": 6, "port": 18006, "engine_config": {"resources": {"threads": 3}}}
    )
    rig.cp.instances = [first, pinned]
    rig.settle()
    assert (threads_of(rig, 5), threads_of(rig, 6)) == (1, 3)
    message = rig.observed()[6].message  # type: ignore[attr-defined]
    assert message.endswith(", 3 CPU threads (engine config)")


def test_on_a_gpu_host_too_and_a_new_instance_does_not_replace_a_serving_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_cores(monkeypatch, 4)
    rig = Rig(tmp_path, selection=BackendSelection("nvml", RecordingBackend()))
    first = desired(checkpoint(tmp_path / "v1", 1))
    rig.cp.instances = [first]
    rig.settle()
    assert threads_of(rig, 5) == 4
    rig.health.ready = True
    rig.clock.advance(5)
    rig.agent.supervisor.tick()
    # A second instance (a scale-up, a surge canary) splits the cores from its own start on;
    # the engine already serving keeps its threads until it next starts.
    rig.cp.instances = [first, first.model_copy(update={"instance_id": 6, "port": 18006})]
    rig.cp.generation = 2
    rig.settle()
    assert len(rig.launcher.launched) == 2
    assert rig.launcher.launched[0][2].signals == []
    assert (threads_of(rig, 5), threads_of(rig, 6)) == (4, 2)


class RecordingBackend:
    """A GPU backend like NVML: real devices, so it ignores what the engines report."""

    name = "nvml"
    engine_device = "auto"

    def __init__(self) -> None:
        self.sources: list[EngineLoadSource] = []

    def sample(self) -> GpuSnapshot:
        return GpuSnapshot("nvml", "550.54.15", "12.4", ())

    def observe_engines(self, engine_load: EngineLoadSource) -> None:
        self.sources.append(engine_load)

    def close(self) -> None:
        pass


def test_every_backend_is_told_about_the_engines_and_picks_their_device(tmp_path: Path) -> None:
    backend = RecordingBackend()
    rig = Rig(tmp_path, selection=BackendSelection("nvml", backend))
    assert len(backend.sources) == 1 and list(backend.sources[0]()) == []
    rig.cp.instances = [desired(checkpoint(tmp_path / "v1", 1))]
    rig.settle()
    [load] = backend.sources[0]()
    assert load.pid == rig.launcher.last.pid
    config = yaml.safe_load(rig.agent.supervisor.config_path(5).read_text())
    assert config["resources"]["device"] == "auto"


def test_an_unexpected_error_in_one_pass_is_logged_once_and_the_loop_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = Rig(tmp_path)
    stop = threading.Event()
    passes: list[set[str]] = []

    def disk_gone(in_use: set[str]) -> list[str]:
        passes.append(in_use)
        rig.clock.advance(10)  # the next pass heartbeats again
        if len(passes) == 3:
            stop.set()
        raise OSError("snapshot store unreadable")

    rig.agent.store.prune = disk_gone  # type: ignore[method-assign]
    rig.agent.run(stop)  # returns when stopped instead of raising on the first pass
    assert len(passes) == 3 and len(rig.cp.beats) == 3
    assert caplog.text.count("agent loop error; carrying on") == 1
