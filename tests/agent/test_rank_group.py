"""A parallel engine to the agent: one supervised process group, its ranks' rendezvous on a free
loopback port picked at each start, and no rank outliving a stop, a restart or a crash (real
processes: a stub engine that starts a "rank" child ignoring SIGTERM, as a worker waiting on its
collectives would)."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.admission import memory_shortfall
from agent.engine_process import HttpProber, SubprocessLauncher
from agent.gpu import FakeBackend
from agent.instance_spec import InstanceSpec, SupervisorPolicy
from agent.rank_group import free_local_port, may_run_ranks
from agent.supervisor import Supervisor
from protocol.wire import DesiredInstance, InstanceState, Manifest, MemoryPlan, ModelVersionRef
from tests.agent.fakes import FakeLauncher, Health
from tests.clock import FakeClock

DIGEST = "d" * 64
GIB = 2**30
MANIFEST = Manifest(files=[{"path": "config.json", "size": 2, "sha256": "a" * 64}])
TWO_RANKS: dict[str, Any] = {"parallel": {"size": 2}}

# Rank 0 starts rank 1 in its own process group (as torch.multiprocessing does), records both
# pids and the rendezvous it was given beside its config, then serves the health endpoints.
STUB_ENGINE = """
import http.server, json, os, signal, subprocess, sys, yaml
config_path = sys.argv[sys.argv.index("--config") + 1]
config = yaml.safe_load(open(config_path))
if os.environ.get("STUB_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                         "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
record = {"rank0": os.getpid(), "rank1": rank.pid, "master_addr": os.environ.get("MASTER_ADDR"),
          "master_port": os.environ.get("MASTER_PORT")}
with open(config_path + ".tmp", "w") as out:
    json.dump(record, out)
os.replace(config_path + ".tmp", config_path + ".ranks.json")
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path.startswith("/health") else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", config["service"]["port"]), H).serve_forever()
"""


def spec(port: int = 18001, gpus: tuple[int, ...] = (0, 1), **config: Any) -> InstanceSpec:
    return InstanceSpec(
        instance_id=5, deployment="moe", digest=DIGEST, snapshot_path="/snap/x", port=port,
        gpu_indices=gpus, engine_config=dict(config), device="auto",
    )  # fmt: skip


# --- the rendezvous, with a fake launcher -------------------------------------------------------


def fake_supervisor(tmp_path: Path, env: dict[str, str]) -> tuple[Supervisor, FakeLauncher]:
    launcher, ports = FakeLauncher(), iter([29411, 29412, 29413])
    sup = Supervisor(
        tmp_path / "run", launcher, Health(), clock=FakeClock().monotonic,
        policy=SupervisorPolicy(backoff_initial_s=0), engine_command=["engine-bin"], env=env,
        rendezvous_port=lambda: next(ports),
    )  # fmt: skip
    return sup, launcher


def test_a_parallel_engine_gets_its_gpus_and_a_new_rendezvous_port_at_each_start(
    tmp_path: Path,
) -> None:
    # What an agent inherited from a launcher of its own never reaches its engines.
    inherited = {"PATH": "/bin", "MASTER_PORT": "1", "RANK": "3", "WORLD_SIZE": "8"}
    sup, launcher = fake_supervisor(tmp_path, inherited)
    sup.ensure(spec(**TWO_RANKS))
    argv, env, first = launcher.launched[0]
    assert len(launcher.launched) == 1  # one process: rank 0 starts the others
    assert argv == ["engine-bin", "--config", str(sup.config_path(5))]
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29411"}  # fmt: skip
    assert "ranks meet on 127.0.0.1:29411" in sup.observed()[0].message
    first.code = -9  # a rank died and took rank 0 down with it
    sup.tick()
    sup.tick()  # the restart, after a backoff of 0 s
    assert len(launcher.launched) == 2
    assert launcher.launched[1][1]["MASTER_PORT"] == "29412"


def test_an_engine_of_one_rank_gets_no_rendezvous(tmp_path: Path) -> None:
    sup, launcher = fake_supervisor(tmp_path, {"PATH": "/bin", "MASTER_ADDR": "10.0.0.1"})
    sup.ensure(spec(gpus=(3,)))
    assert launcher.launched[0][1] == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"}


def test_who_may_run_several_ranks() -> None:
    assert may_run_ranks(spec(), {"parallel": {"size": 2}})
    assert not may_run_ranks(spec(), {"parallel": {"size": 1}})
    # Left out: one rank per GPU the engine sees, all of the host's for ().
    assert may_run_ranks(spec(gpus=(0, 1)), {})
    assert may_run_ranks(spec(gpus=()), {})
    assert not may_run_ranks(spec(gpus=(2,)), {})
    # On a CPU one rank, unless the size says more.
    assert not may_run_ranks(spec(), {"resources": {"device": "cpu"}})
    assert not may_run_ranks(replace(spec(), device="cpu"), {})
    assert may_run_ranks(spec(), {"resources": {"device": "cpu"}, "parallel": {"size": 4}})


def test_an_instance_is_admitted_when_each_gpu_holds_its_rank() -> None:
    # Two H100s with 79.1 GiB free each, and 100 GiB of weights: half on each of two ranks.
    sample = FakeBackend("2xH100").sample()
    plan = MemoryPlan(weights_bytes=100 * GIB, kv_bytes_per_token=0)

    def instance(**config: Any) -> DesiredInstance:
        model = ModelVersionRef(
            name="moe", version="v1", digest=DIGEST, manifest=MANIFEST,
            source_uri="/snap", memory_plan=plan,
        )  # fmt: skip
        return DesiredInstance(
            instance_id=5, deployment="moe", model=model, port=18005, gpu_indices=[0, 1],
            engine_config=config,
        )  # fmt: skip

    assert memory_shortfall(instance(), sample) is None
    assert memory_shortfall(instance(parallel={"size": 2}), sample) is None
    one = memory_shortfall(instance(parallel={"size": 1}), sample)
    assert one is not None and "needs 100.0 GiB (weights + KV" in one


def test_the_rendezvous_port_is_free_to_bind() -> None:
    port = free_local_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


# --- the whole group, with real processes ------------------------------------------------------


def gone(pid: int) -> bool:
    """Whether PID has exited (a zombie has: only its parent, maybe init, has not reaped it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def wait_for(condition: Callable[[], bool], sup: Supervisor, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.tick()
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out; observed {sup.observed()}")


def http_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Group:
    """A supervisor running the stub engine, and the ranks its starts recorded."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        stub = tmp_path / "stub_engine.py"
        stub.write_text(STUB_ENGINE)
        self.prober = HttpProber(timeout_s=0.5)
        self.sup = Supervisor(
            tmp_path / "run", SubprocessLauncher(), self.prober,
            policy=SupervisorPolicy(probe_interval_s=0.1, backoff_initial_s=0.2, stop_grace_s=1),
            engine_command=[sys.executable, str(stub)], env={**os.environ, **env},
        )  # fmt: skip
        self.spec = spec(port=http_port(), gpus=(), **TWO_RANKS)
        self.seen: list[dict[str, Any]] = []

    def ranks(self) -> dict[str, Any]:
        """The ranks of the engine's latest start, once it is ready."""
        wait_for(lambda: self.sup.state_of(5) == InstanceState.READY, self.sup)
        record = json.loads(Path(f"{self.sup.config_path(5)}.ranks.json").read_text())
        if record not in self.seen:
            self.seen.append(record)
        return dict(record)

    def close(self) -> None:
        self.sup.stop_all(timeout_s=5)
        self.prober.close()
        for record in self.seen:  # whatever a failed test left behind
            for pid in (record["rank0"], record["rank1"]):
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture()
def group(tmp_path: Path) -> Iterator[Group]:
    made = Group(tmp_path, {})
    yield made
    made.close()


def test_stopping_the_instance_ends_every_rank(group: Group) -> None:
    group.sup.ensure(group.spec)
    ranks = group.ranks()
    assert ranks["master_addr"] == "127.0.0.1" and int(ranks["master_port"]) > 0
    group.sup.stop(5)
    # Rank 0 drains on SIGTERM and exits; rank 1 ignores SIGTERM and is killed with its group.
    wait_for(lambda: group.sup.state_of(5) == InstanceState.STOPPED, group.sup)
    assert gone(ranks["rank0"])
    wait_for(lambda: gone(ranks["rank1"]), group.sup, timeout_s=5)


def test_a_crash_and_a_new_spec_restart_the_whole_group(group: Group) -> None:
    group.sup.ensure(group.spec)
    first = group.ranks()
    os.kill(first["rank0"], signal.SIGKILL)  # rank 0 dies: its rank 1 must not live on
    wait_for(lambda: group.sup.observed()[0].restart_count == 1, group.sup)
    wait_for(lambda: gone(first["rank1"]), group.sup, timeout_s=5)  # SIGKILL lands at once
    second = group.ranks()
    assert second["rank0"] != first["rank0"] and not gone(second["rank1"])

    group.sup.ensure(replace(group.spec, digest="e" * 64))  # replaced: drained, then started
    third = group.ranks()
    assert third["rank0"] != second["rank0"]
    assert gone(second["rank0"])
    wait_for(lambda: gone(second["rank1"]), group.sup, timeout_s=5)
    assert not gone(third["rank1"])


def test_an_engine_deaf_to_sigterm_is_killed_with_its_ranks(tmp_path: Path) -> None:
    group = Group(tmp_path, {"STUB_IGNORE_TERM": "1"})
    try:
        group.sup.ensure(group.spec)
        ranks = group.ranks()
        group.sup.stop(5)  # the grace is 1 s, then SIGKILL to the group
        wait_for(lambda: group.sup.state_of(5) == InstanceState.STOPPED, group.sup)
        assert gone(ranks["rank0"])
        wait_for(lambda: gone(ranks["rank1"]), group.sup, timeout_s=5)
    finally:
        group.close()


def test_an_adopted_engine_that_dies_takes_its_ranks_along(tmp_path: Path) -> None:
    group = Group(tmp_path, {})
    try:
        group.sup.ensure(group.spec)
        ranks = group.ranks()
        # A new agent (same run dir) adopts the running engine: not its child.
        again = Supervisor(
            group.sup.run_dir, SubprocessLauncher(), group.prober,
            policy=group.sup.policy, engine_command=group.sup.engine_command,
        )  # fmt: skip
        assert again.adopt_existing() == [5]
        try:
            os.kill(ranks["rank0"], signal.SIGKILL)
            wait_for(lambda: again.observed()[0].restart_count == 1, again)
            wait_for(lambda: gone(ranks["rank1"]), again, timeout_s=5)
        finally:
            again.stop_all(timeout_s=5)  # and the engine it started again
    finally:
        group.close()
