"""Supervisor state machine with an injected clock, launcher and prober (no sleeping)."""

from __future__ import annotations

import signal
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from agent.engine_process import PidRecord, rotate_log, truncate_if_large
from agent.instance_spec import InstanceSpec, SupervisorPolicy, engine_config
from agent.supervisor import Supervisor
from protocol.wire import InstanceState
from tests.agent.fakes import FakeLauncher, Health
from tests.clock import FakeClock

DIGEST = "a" * 64


@pytest.fixture()
def rig(tmp_path: Path) -> tuple[Supervisor, FakeLauncher, FakeClock, Health, list[str]]:
    launcher, clock, health = FakeLauncher(), FakeClock(), Health()
    transitions: list[str] = []
    sup = Supervisor(
        tmp_path / "run",
        launcher,
        health,
        clock=clock.monotonic,
        policy=SupervisorPolicy(startup_grace_s=60, probe_interval_s=1, stop_grace_s=10),
        engine_command=["engine-bin"],
        on_transition=lambda i, old, new, msg: transitions.append(f"{i}:{new.value}"),
        env={"PATH": "/bin"},
    )
    return sup, launcher, clock, health, transitions


def spec(port: int = 18001, digest: str = DIGEST, **config: object) -> InstanceSpec:
    return InstanceSpec(
        instance_id=7, deployment="demo", digest=digest, snapshot_path="/snap/x", port=port,
        gpu_indices=(0, 1), engine_config=dict(config), device="cpu",
    )  # fmt: skip


def test_start_writes_the_config_and_becomes_ready(rig: tuple) -> None:
    sup, launcher, clock, health, transitions = rig
    sup.ensure(spec(model={"threshold": 0.8, "path": "/evil"}, service={"port": 1}))
    argv, env, _ = launcher.launched[0]
    assert argv == ["engine-bin", "--config", str(sup.config_path(7))]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    config = yaml.safe_load(sup.config_path(7).read_text())
    assert config["service"] == {"host": "127.0.0.1", "port": 18001}
    assert config["model"] == {"path": "/snap/x", "snapshot_digest": DIGEST,
                               "served_name": "demo", "threshold": 0.8}  # fmt: skip
    assert config["resources"]["device"] == "cpu"
    sup.tick()
    assert sup.state_of(7) == InstanceState.STARTING
    health.ready = True
    clock.advance(1)
    sup.tick()
    assert sup.state_of(7) == InstanceState.READY
    assert transitions == ["7:starting", "7:ready"]
    record = PidRecord.load(sup.run_dir / "instance-7.json")
    assert record is not None and record.pid == launcher.last.pid and record.port == 18001


def test_crash_restarts_with_doubling_backoff_then_crash_loop(rig: tuple) -> None:
    sup, launcher, clock, _health, _ = rig
    sup.ensure(spec())
    delays = []
    for _ in range(6):
        launcher.last.code = -9  # kill -9
        sup.tick()
        observed = sup.observed()[0]
        assert observed.last_exit is not None and observed.last_exit.signal == 9
        delays.append(float(observed.message.rsplit("restart in ", 1)[1].split()[0]))
        before = len(launcher.launched)
        clock.advance(delays[-1] - 0.5)
        sup.tick()
        assert len(launcher.launched) == before  # still waiting
        clock.advance(0.5)
        sup.tick()
        assert len(launcher.launched) == before + 1
    assert delays == [1, 2, 4, 8, 16, 32]
    assert sup.observed()[0].restart_count == 6
    launcher.last.code = 1
    sup.tick()
    assert sup.state_of(7) == InstanceState.CRASH_LOOP
    # The port is kept across restarts.
    assert {a[0][-1] for a in launcher.launched} == {str(sup.config_path(7))}
    assert yaml.safe_load(sup.config_path(7).read_text())["service"]["port"] == 18001


def test_backoff_is_capped() -> None:
    policy = SupervisorPolicy()
    assert policy.backoff_s(1) == 1 and policy.backoff_s(9) == 256 and policy.backoff_s(30) == 300


def test_a_stable_engine_forgets_its_failure_streak(rig: tuple) -> None:
    sup, launcher, clock, health, _ = rig
    sup.ensure(spec())
    launcher.last.code = 1
    sup.tick()
    clock.advance(1)
    sup.tick()
    health.ready = True
    for _ in range(70):
        clock.advance(1)
        sup.tick()
    launcher.last.code = 1
    sup.tick()
    assert "restart in 1 s" in sup.observed()[0].message


def test_not_ready_within_grace_is_killed_and_restarted(rig: tuple) -> None:
    sup, launcher, clock, _health, _ = rig
    sup.ensure(spec())
    first = launcher.last
    clock.advance(61)
    sup.tick()
    assert signal.SIGKILL in first.signals
    assert sup.state_of(7) == InstanceState.BACKOFF
    assert "not ready within the start-up grace" in sup.observed()[0].message


def test_failed_liveness_probes_restart_the_engine(rig: tuple) -> None:
    sup, _launcher, clock, health, _ = rig
    sup.ensure(spec())
    health.ready = True
    sup.tick()
    health.ready = health.live = False
    for expected in (InstanceState.UNHEALTHY, InstanceState.UNHEALTHY, InstanceState.BACKOFF):
        clock.advance(1)
        sup.tick()
        assert sup.state_of(7) == expected
    assert "3 liveness probes failed" in sup.observed()[0].message


def test_alive_but_not_ready_is_unhealthy_not_restarted(rig: tuple) -> None:
    sup, launcher, clock, health, _ = rig
    sup.ensure(spec())
    health.ready = True
    sup.tick()
    health.ready = False
    for _ in range(5):
        clock.advance(1)
        sup.tick()
    assert sup.state_of(7) == InstanceState.UNHEALTHY
    assert len(launcher.launched) == 1


def test_stop_drains_then_kills_after_the_grace(rig: tuple) -> None:
    sup, launcher, clock, _health, _ = rig
    sup.ensure(spec())
    proc = launcher.last
    proc.exit_on_term = False  # ignores SIGTERM
    sup.stop(7, remove=True)
    assert proc.signals == [signal.SIGTERM]
    assert sup.state_of(7) == InstanceState.STOPPING
    clock.advance(9)
    sup.tick()
    assert proc.signals == [signal.SIGTERM]
    clock.advance(1)
    sup.tick()
    assert proc.signals == [signal.SIGTERM, signal.SIGKILL]
    sup.tick()
    assert sup.instance_ids() == []
    assert not (sup.run_dir / "instance-7.json").exists()


def test_a_stop_repeated_while_draining_sends_no_second_sigterm(rig: tuple) -> None:
    """Every heartbeat repeats the desired stop; an engine takes a second SIGTERM as "exit now"
    and would cut off the requests it is finishing (a rolling restart lost one so)."""
    sup, launcher, clock, _health, _ = rig
    sup.ensure(spec())
    proc = launcher.last
    proc.exit_on_term = False  # still draining
    sup.stop(7)
    clock.advance(5)
    sup.stop(7)
    sup.ensure(spec(digest="b" * 64))  # replaced meanwhile: started once the old one exits
    sup.stop(7)
    assert proc.signals == [signal.SIGTERM]
    clock.advance(5)  # the grace counts from the first stop
    sup.tick()
    assert proc.signals == [signal.SIGTERM, signal.SIGKILL]
    sup.tick()
    assert sup.state_of(7) == InstanceState.STOPPED and len(launcher.launched) == 1


def test_a_new_spec_drains_the_old_engine_then_starts_the_new(rig: tuple) -> None:
    sup, launcher, _clock, _health, _ = rig
    sup.ensure(spec())
    old = launcher.last
    sup.ensure(spec())  # same spec: nothing happens
    assert len(launcher.launched) == 1
    sup.ensure(spec(digest="b" * 64))
    assert old.signals == [signal.SIGTERM]
    sup.tick()
    assert len(launcher.launched) == 2
    assert yaml.safe_load(sup.config_path(7).read_text())["model"]["snapshot_digest"] == "b" * 64


def test_restarted_agent_adopts_a_live_engine_instead_of_starting_another(rig: tuple) -> None:
    sup, launcher, clock, health, _ = rig
    sup.ensure(spec())
    health.ready = True
    sup.tick()
    pid = launcher.last.pid
    second = Supervisor(
        sup.run_dir, launcher, health, clock=clock.monotonic, engine_command=["engine-bin"]
    )
    assert second.adopt_existing() == [7]
    second.ensure(spec())
    assert len(launcher.launched) == 1
    second.tick()
    assert second.state_of(7) == InstanceState.READY
    assert second.observed()[0].pid == pid


def test_a_dead_engine_is_not_adopted(rig: tuple) -> None:
    sup, launcher, clock, health, _ = rig
    sup.ensure(spec())
    launcher.alive.clear()
    second = Supervisor(
        sup.run_dir, launcher, health, clock=clock.monotonic, engine_command=["engine-bin"]
    )
    assert second.adopt_existing() == []
    assert not (sup.run_dir / "instance-7.json").exists()


def test_engine_config_keeps_agent_keys() -> None:
    # Stored before served_name was the agent's to decide: the gateway routes by deployment name.
    config = engine_config(spec(model={"snapshot_digest": "x", "served_name": "alias"}))
    assert config["model"]["snapshot_digest"] == DIGEST
    assert config["model"]["served_name"] == "demo"


def test_logs_rotate_on_start_and_copy_truncate_when_large(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    for text in ("one", "two", "three"):
        rotate_log(log, keep=2)
        log.write_text(text)
    assert log.read_text() == "three"
    assert (tmp_path / "engine.log.1").read_text() == "two"
    assert (tmp_path / "engine.log.2").read_text() == "one"
    assert not (tmp_path / "engine.log.3").exists()
    with log.open("ab") as writer:  # the engine keeps appending through its own handle
        writer.write(b"x" * 100)
        writer.flush()
        assert truncate_if_large(log, max_bytes=50, keep=2)
        writer.write(b"after")
        writer.flush()
    assert log.read_bytes() == b"after"
    assert (tmp_path / "engine.log.1").read_bytes() == b"three" + b"x" * 100


def test_a_live_engine_that_does_not_answer_yet_is_adopted_not_duplicated(rig: tuple) -> None:
    sup, launcher, clock, health, _ = rig
    sup.ensure(spec())
    health.live = health.ready = False  # still loading its weights
    second = Supervisor(
        sup.run_dir, launcher, health, clock=clock.monotonic, engine_command=["engine-bin"]
    )
    assert second.adopt_existing() == [7]
    second.ensure(spec())
    assert len(launcher.launched) == 1
    assert second.state_of(7) == InstanceState.STARTING


def test_a_failed_instance_starts_when_it_is_wanted_again(rig: tuple) -> None:
    sup, launcher, _clock, _health, _ = rig
    sup.mark_failed(7, spec(), "not started: model needs 400.0 GiB")
    assert sup.state_of(7) == InstanceState.FAILED and launcher.launched == []
    sup.ensure(spec())
    assert sup.state_of(7) == InstanceState.STARTING and len(launcher.launched) == 1


def test_the_engine_is_python_m_engine_serve_with_its_config_file(tmp_path: Path) -> None:
    launcher = FakeLauncher()
    sup = Supervisor(tmp_path / "run", launcher, Health(), clock=FakeClock().monotonic, env={})
    sup.ensure(spec())
    argv, _, _ = launcher.launched[0]
    assert argv == [sys.executable, "-m", "engine.serve", "--config", str(sup.config_path(7))]


def test_api_key_and_bind_address_reach_only_the_0600_config(tmp_path: Path) -> None:
    launcher, health = FakeLauncher(), Health()
    sup = Supervisor(
        tmp_path / "run", launcher, health, clock=FakeClock().monotonic,
        engine_command=["engine-bin"],
        env={"PATH": "/bin", "DCTL_BOOTSTRAP_TOKEN": "boot-secret", "CUDA_VISIBLE_DEVICES": "3"},
    )  # fmt: skip
    keyed = replace(spec(service={"api_key": "from-deployment"}), bind_address="10.1.2.3",
                    api_key="sk-instance-secret", gpu_indices=())  # fmt: skip
    sup.ensure(keyed)
    argv, env, _ = launcher.launched[0]
    config_file = sup.config_path(7)
    assert stat.S_IMODE(config_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(sup.run_dir.stat().st_mode) == 0o700
    service = yaml.safe_load(config_file.read_text())["service"]
    assert service == {"host": "10.1.2.3", "port": 18001, "api_key": "sk-instance-secret"}
    pid_file = sup.run_dir / "instance-7.json"
    assert stat.S_IMODE(pid_file.stat().st_mode) == 0o600
    for text in (" ".join(argv), repr(env), pid_file.read_text(), repr(keyed),
                 repr(sup.observed())):  # fmt: skip
        assert "sk-instance-secret" not in text
    # The agent's own secrets stay out of the engine; no GPU list means the agent's view.
    assert "DCTL_BOOTSTRAP_TOKEN" not in env and env["CUDA_VISIBLE_DEVICES"] == "3"
    sup.tick()
    assert health.calls[-1] == ("10.1.2.3", 18001, "/health/ready")


def test_a_wildcard_bind_address_is_probed_on_loopback(rig: tuple) -> None:
    sup, _launcher, _clock, health, _ = rig
    sup.ensure(replace(spec(), bind_address="0.0.0.0"))
    health.ready = True
    sup.tick()
    assert health.calls[-1] == ("127.0.0.1", 18001, "/health/ready")
    assert sup.ready_endpoints() == {7: ("127.0.0.1", 18001, "/metrics")}


def test_a_new_api_key_replaces_the_engine(rig: tuple) -> None:
    sup, launcher, _clock, _health, _ = rig
    sup.ensure(replace(spec(), api_key="key-1"))
    old = launcher.last
    sup.ensure(replace(spec(), api_key="key-1"))
    assert len(launcher.launched) == 1
    sup.ensure(replace(spec(), api_key="key-2"))
    assert old.signals == [signal.SIGTERM]
    sup.tick()
    assert len(launcher.launched) == 2
    assert yaml.safe_load(sup.config_path(7).read_text())["service"]["api_key"] == "key-2"


def test_an_adopted_engine_keeps_its_api_key(rig: tuple) -> None:
    sup, launcher, clock, health, _ = rig
    keyed = replace(spec(), api_key="key-1", bind_address="10.1.2.3")
    sup.ensure(keyed)
    pid = launcher.last.pid
    second = Supervisor(
        sup.run_dir, launcher, health, clock=clock.monotonic, engine_command=["engine-bin"]
    )
    assert second.adopt_existing() == [7]
    assert health.calls[-1] == ("10.1.2.3", 18001, "/health/live")
    second.ensure(keyed)  # same key (read back from the config): no restart
    assert len(launcher.launched) == 1
    launcher.last.code = 1  # a crash restarts it with its key, control plane or not
    second.tick()
    clock.advance(2)
    second.tick()
    assert len(launcher.launched) == 2 and launcher.last.pid != pid
    assert yaml.safe_load(second.config_path(7).read_text())["service"]["api_key"] == "key-1"
