"""The supervisor with real processes: a stub engine (HTTP health endpoints) on loopback."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.engine_process import HttpProber, SubprocessLauncher
from agent.instance_spec import InstanceSpec, SupervisorPolicy
from agent.supervisor import Supervisor
from protocol.wire import InstanceState

STUB_ENGINE = """
import http.server, sys, yaml
config = yaml.safe_load(open(sys.argv[sys.argv.index("--config") + 1]))
port = config["service"]["port"]
print("stub engine on", port, flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path.startswith("/health") else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], sup: Supervisor, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.tick()
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out; observed {sup.observed()}")


@pytest.fixture()
def stub(tmp_path: Path) -> Path:
    path = tmp_path / "stub_engine.py"
    path.write_text(STUB_ENGINE)
    return path


@pytest.fixture()
def supervisors(tmp_path: Path, stub: Path) -> Iterator[Callable[[], Supervisor]]:
    made: list[Supervisor] = []
    prober = HttpProber(timeout_s=0.5)

    def make() -> Supervisor:
        sup = Supervisor(
            tmp_path / "run",
            SubprocessLauncher(),
            prober,
            policy=SupervisorPolicy(probe_interval_s=0.1, backoff_initial_s=0.2, stop_grace_s=3),
            engine_command=[sys.executable, str(stub)],
        )
        made.append(sup)
        return sup

    yield make
    for sup in made:
        sup.stop_all(timeout_s=5)
    prober.close()


def test_real_engine_kill9_restart_adoption_and_stop(
    tmp_path: Path, supervisors: Callable[[], Supervisor]
) -> None:
    spec = InstanceSpec(
        instance_id=3, deployment="demo", digest="c" * 64, snapshot_path=str(tmp_path),
        port=free_port(),
    )  # fmt: skip
    sup = supervisors()
    sup.ensure(spec)
    wait_for(lambda: sup.state_of(3) == InstanceState.READY, sup)
    first_pid = sup.observed()[0].pid
    assert first_pid is not None
    assert "stub engine on" in sup.log_path(3).read_text()

    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: sup.observed()[0].restart_count == 1, sup)
    assert sup.observed()[0].last_exit.signal == 9  # type: ignore[union-attr]
    wait_for(lambda: sup.state_of(3) == InstanceState.READY, sup)
    second_pid = sup.observed()[0].pid
    assert second_pid != first_pid
    assert sup.observed()[0].port == spec.port

    # A new agent (same run dir) adopts the running engine instead of starting a second one.
    again = supervisors()
    assert again.adopt_existing() == [3]
    again.ensure(spec)
    wait_for(lambda: again.state_of(3) == InstanceState.READY, again)
    assert again.observed()[0].pid == second_pid

    again.stop_all(timeout_s=5)
    assert again.instance_ids() == []
    # The old supervisor's Popen would reap it; a zombie (Z) has exited all the same.
    stat = Path(f"/proc/{second_pid}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
