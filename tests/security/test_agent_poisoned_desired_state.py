"""Threat: one poisoned desired instance takes the agent (every agent that receives it) down.

A control plane (or whoever answers in its place) sends a desired instance the agent cannot
apply: an engine config that is not a mapping, a wire field out of range, an id a heartbeat
cannot carry, GPUs the host does not have. The agent must stay up and keep heartbeating; that
instance is reported `failed` with the reason, and the other instances are applied.
"""

from __future__ import annotations

from pathlib import Path

from protocol.wire import InstanceState
from tests.agent.fakes import FakeLauncher
from tests.agent.loopback import (
    FakeControlPlane,
    agent_command,
    agent_env,
    agent_for,
    agent_log,
    checkpoint,
    desired_instance,
    run_agent,
    settle,
    wait_until,
)
from tests.processes import stop


def test_a_malformed_engine_config_does_not_make_the_agent_process_exit(tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "weights")
    poisoned = desired_instance(src, instance_id=5, engine_config={"service": "x"})
    with FakeControlPlane(instances=[poisoned]) as cp:
        argv = agent_command(cp.url, tmp_path / "data")
        agent = run_agent(tmp_path, argv, agent_env(tmp_path, DCTL_BOOTSTRAP_TOKEN="boot"))
        try:

            def reported_failed() -> bool:
                observed = cp.observed().get(5)
                return observed is not None and observed.state == InstanceState.FAILED

            wait_until(
                "instance 5 reported failed",
                lambda: reported_failed() or agent.poll() is not None,
            )
            assert agent.poll() is None, f"the agent exited:\n{agent_log(tmp_path)[-3000:]}"
            message = cp.observed()[5].message
            assert "engine config refused" in message and "service" in message
            beats = len(cp.beats)
            wait_until("more heartbeats", lambda: len(cp.beats) >= beats + 3)
            assert agent.poll() is None
            assert cp.observed()[5].state == InstanceState.FAILED
        finally:
            stop(agent)


def test_one_unappliable_instance_leaves_the_others_applied(tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "weights")
    good = desired_instance(src, instance_id=1)
    bad_config = desired_instance(src, instance_id=2, engine_config={"service": "x"})
    bad_wire = desired_instance(src, instance_id=3, port=0)  # not a port: fails validation
    no_such_gpu = desired_instance(src, instance_id=4, gpu_indices=[7])
    unreportable = desired_instance(src, instance_id=0)  # no heartbeat can carry id 0
    launcher = FakeLauncher()
    instances = [good, bad_config, bad_wire, no_such_gpu, unreportable]
    with FakeControlPlane(instances=instances) as cp:
        agent = agent_for(tmp_path, cp.url, launcher)
        agent.sample_gpus()  # the host's GPUs are known, as after any heartbeat
        settle(agent)
        settle(agent)
        observed = cp.observed()
    assert [argv[-1] for argv, _, _ in launcher.launched] == [str(agent.supervisor.config_path(1))]
    assert observed[1].state == InstanceState.STARTING
    assert observed[2].state == InstanceState.FAILED
    assert "engine config refused" in observed[2].message
    assert observed[3].state == InstanceState.FAILED and "port" in observed[3].message
    assert observed[4].state == InstanceState.FAILED and "no GPU [7]" in observed[4].message
    assert 0 not in observed


def test_a_bad_config_for_a_running_instance_keeps_its_engine_serving(tmp_path: Path) -> None:
    src = checkpoint(tmp_path / "weights")
    launcher = FakeLauncher()
    with FakeControlPlane(instances=[desired_instance(src, instance_id=1)]) as cp:
        agent = agent_for(tmp_path, cp.url, launcher)
        settle(agent)
        cp.instances = [desired_instance(src, instance_id=1, engine_config={"model": [1]})]
        settle(agent)
        observed = cp.observed()[1]
    assert len(launcher.launched) == 1 and launcher.last.signals == []
    assert observed.state == InstanceState.STARTING
    assert "engine config refused: engine_config: model" in observed.message
