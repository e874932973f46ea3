"""The agent with real processes: control plane, agent and engine on loopback.

The tests share one stack and run in file order; each leaves the stack serving `demo:v1`.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from protocol.manifest import compute_manifest
from protocol.rest import DeploymentUpdate, InstanceOut
from tests.agent_e2e.conftest import HOST, Stack, wait_for


def engine_config(stack: Stack, inst: InstanceOut) -> Path:
    return stack.agent_data() / "agent" / "run" / f"instance-{inst.id}.yaml"


def complete(stack: Stack, inst: InstanceOut) -> dict[str, object]:
    """One completion straight from the engine, with the API key the agent gave it."""
    key = yaml.safe_load(engine_config(stack, inst).read_text())["service"].get("api_key")
    response = httpx.post(
        f"http://127.0.0.1:{inst.port}/v1/completions",
        json={"model": "demo", "prompt": "Hello", "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"} if key else {},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def agent_metrics(stack: Stack) -> dict[str, float]:
    port = (stack.agent_data() / "agent" / "metrics-port").read_text().strip()
    return metrics(f"http://127.0.0.1:{port}/metrics")


def engine_processes(stack: Stack, instance_id: int) -> list[int]:
    """Pids whose command line runs this instance's engine config."""
    # The full path: other stacks on this machine (parallel runs) have an instance 1 too.
    marker = str(stack.agent_data() / "agent" / "run" / f"instance-{instance_id}.yaml")
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in cmdline and b"engine" in cmdline and state != "Z":
                found.append(int(proc.name))
    return found


def test_registers_heartbeats_and_the_instance_becomes_ready(stack: Stack) -> None:
    inst = stack.ready_instance()
    host = stack.api.get_host(HOST)
    assert host.state == "ready"
    assert host.facts is not None and host.facts.gpu_backend == "fake"
    assert {c.name for c in host.facts.preflight} >= {"nvml", "gpu_count", "torch", "disk"}
    assert [g.name for g in host.gpus] == ["NVIDIA H200", "NVIDIA H200"]
    assert host.applied_generation == host.desired_generation
    body = complete(stack, inst)
    assert body["usage"]["completion_tokens"] == 4  # type: ignore[index]
    config = engine_config(stack, inst)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    key = yaml.safe_load(config.read_text())["service"].get("api_key")
    if key:  # the control plane issued one: the engine wants it, and no command line shows it
        anonymous = httpx.get(f"http://127.0.0.1:{inst.port}/v1/models", timeout=10)
        assert anonymous.status_code == 401
        assert inst.pid is not None
        assert key.encode() not in Path(f"/proc/{inst.pid}/cmdline").read_bytes()
    token_file = stack.agent_data() / "agent" / "agent-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    own = agent_metrics(stack)
    assert own["dctl_agent_engine_starts_total"] >= 1
    assert own["dctl_agent_snapshot_fetches_total{result=ok}"] == 1
    used = [v for k, v in own.items() if k.startswith("dctl_gpu_memory_used_bytes")]
    assert len(used) == 2 and max(used) > 512 * 2**20  # the engine's memory shows on a GPU


def test_kill_9_engine_is_restarted_on_the_same_port(stack: Stack) -> None:
    before = stack.ready_instance()
    assert before.pid is not None
    os.kill(before.pid, signal.SIGKILL)
    after = wait_for(
        "a restarted engine",
        lambda: (i := stack.instance()).observed_state == "ready" and i.pid != before.pid and i,
        300,
    )
    assert after.restart_count == before.restart_count + 1
    assert after.last_exit is not None and after.last_exit.signal == 9
    assert after.port == before.port
    complete(stack, after)


def test_corrupt_snapshot_is_refused_and_the_old_one_keeps_serving(stack: Stack) -> None:
    serving = stack.ready_instance()
    v1_digest = compute_manifest(stack.checkpoints["v1"]).digest()
    stack.dctl("model", "register", "demo:v2", str(stack.checkpoints["v2"]))
    weights = next(stack.checkpoints["v2"].glob("*.safetensors"))
    blob = bytearray(weights.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # changed after registration: the manifest no longer matches
    weights.write_bytes(bytes(blob))
    stack.api.update_deployment("demo", DeploymentUpdate(version="v2"))
    refused = wait_for(
        "the refusal to be reported",
        lambda: "does not match" in (i := stack.instance()).message and i,
        60,
    )
    assert weights.name in refused.message
    assert refused.observed_state == "ready" and refused.pid == serving.pid
    info = metrics(f"http://127.0.0.1:{serving.port}/metrics")
    assert any(v1_digest in key for key in info if key.startswith("dllm_model_info"))
    complete(stack, serving)
    assert agent_metrics(stack)["dctl_agent_snapshot_fetches_total{result=mismatch}"] == 1
    store = stack.agent_data() / "snapshots"
    assert (store / "snapshots" / v1_digest).is_dir()
    assert not any((store / "partial").iterdir())
    stack.api.update_deployment("demo", DeploymentUpdate(version="v1"))
    back = wait_for(
        "v1 again", lambda: "does not match" not in (i := stack.instance()).message and i
    )
    assert back.pid == serving.pid  # same snapshot, same engine: nothing restarted


def test_restarted_agent_adopts_the_engine_instead_of_starting_another(stack: Stack) -> None:
    serving = stack.ready_instance()
    stack.stop_agent()
    assert engine_processes(stack, serving.id) == [serving.pid]
    stack.start_agent()
    wait_for(
        "the new agent to adopt",
        lambda: "adopted" in (stack.logs / "agent.log").read_text().split("signal 15")[-1],
        240,
    )
    time.sleep(3)  # a few heartbeats and probes: a duplicate would show up now
    assert engine_processes(stack, serving.id) == [serving.pid]
    again = stack.ready_instance()
    assert again.pid == serving.pid
    complete(stack, again)


def test_engines_keep_serving_while_the_control_plane_is_down(stack: Stack) -> None:
    serving = stack.ready_instance()
    db = stack.home / "cp" / "dctl.db"
    query = (
        "select coalesce(sum(value), 0) from metricsample "
        "where instance_id = ? and name like 'dllm_requests_finished_total%'"
    )
    stack.stop_server()
    outage_started = time.monotonic()
    with sqlite3.connect(db) as conn:
        before = conn.execute(query, (serving.id,)).fetchone()[0]
    for _ in range(3):
        complete(stack, serving)
    time.sleep(max(0.0, 4 - (time.monotonic() - outage_started)))  # several missed heartbeats
    assert stack.agent is not None and stack.agent.poll() is None
    assert engine_processes(stack, serving.id) == [serving.pid]
    stack.start_server()
    seen = wait_for(
        "a heartbeat after the outage",
        lambda: (h := stack.api.get_host(HOST)).state == "ready" and h,
        120,
    )
    assert seen.last_seen_at is not None
    assert stack.ready_instance().pid == serving.pid

    def caught_up() -> float | None:
        with sqlite3.connect(db) as conn:
            total = float(conn.execute(query, (serving.id,)).fetchone()[0])
        return total if total >= before + 3 else None

    # The requests served during the outage reach the control plane as deltas afterwards.
    wait_for("the outage's engine metrics", caught_up, 120)
    assert "control plane reachable again" in (stack.logs / "agent.log").read_text()
