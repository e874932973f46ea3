"""`dctl up --demo`: one command brings up control plane, agent, engines and gateway, ready for
a canary rollout, with demo traffic; Ctrl-C stops all, and so do SIGTERM and a hang-up, even once
the demo's stdout is gone."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.demo.traffic import PROMPTS, DemoTraffic
from client.credentials import CredentialsFile
from client.http import ControlPlaneClient
from tests.agent_e2e.conftest import free_port, wait_for


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(proc.name))
            except OSError:
                continue
    return found


def test_demo_traffic_sends_the_prompts_in_turn_and_logs_failures_sparingly() -> None:
    bodies: list[dict[str, object]] = []
    enough = threading.Event()

    def gateway(request: httpx.Request) -> httpx.Response:
        assert request.url == "http://gw/v1/chat/completions"
        assert request.headers["Authorization"] == "Bearer client-key"
        bodies.append(json.loads(request.content))
        if len(bodies) >= 110:
            enough.set()
        if len(bodies) <= len(PROMPTS):
            return httpx.Response(200, json={"choices": []})
        if len(bodies) % 2:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(503, json={"error": {"message": "no ready instance"}})

    lines: list[str] = []
    traffic = DemoTraffic("http://gw/v1", "client-key", rps=1000, say=lines.append,
                          transport=httpx.MockTransport(gateway))  # fmt: skip
    traffic.start()
    try:
        assert enough.wait(30)
    finally:
        traffic.stop()
    assert traffic.sent == len(bodies)
    assert [b["messages"] for b in bodies[: len(PROMPTS)]] == [
        [{"role": "user", "content": p}] for p in PROMPTS
    ]
    assert bodies[len(PROMPTS)]["messages"] == bodies[0]["messages"]  # round and round
    assert {(b["model"], b["max_tokens"]) for b in bodies} == {("demo", 8)}
    assert traffic.failed == len(bodies) - len(PROMPTS) >= 101
    # The first failure and the 101st: one line per hundred at most.
    assert len(lines) == 2, lines
    assert lines[0] == "demo traffic: 1 of 7 requests failed so far (last: ConnectError: refused)"
    assert lines[1].startswith("demo traffic: 101 of 107 requests failed so far")


def test_up_demo_serves_keeps_existing_contexts_and_stops_cleanly(tmp_path: Path) -> None:
    config = tmp_path / "config"
    credentials = config / "dctl" / "credentials"
    credentials.parent.mkdir(parents=True)
    original = 'current = "demo"\n[contexts.demo]\nurl = "http://10.0.0.1:8700"\ntoken = "mine"\n'
    credentials.write_text(original)
    credentials.chmod(0o600)
    data_dir = tmp_path / "demo-data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(config), XDG_DATA_HOME=str(tmp_path))
    port = free_port()
    up = subprocess.Popen(
        # No --size: the trained demo model, as a user gets it.
        [sys.executable, "-m", "cli", "up", "--demo", "--data-dir", str(data_dir),
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 420
        while not any("Ctrl-C stops everything" in line for line in lines):
            assert up.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        output = "".join(lines)
        assert "creating the trained demo model" in output
        match = re.search(r"^OpenAI base URL: (http://127\.0\.0\.1:\d+/v1)$", output, re.M)
        assert match, output
        base_url = match.group(1)
        key = re.search(r"^OpenAI API key: (\S+)$", output, re.M)
        assert key, output
        assert f"Authorization: Bearer {key.group(1)}" in output  # the sample curl uses it
        assert key.group(1).startswith("dctl_")  # a client token of the gateway
        refused = httpx.get(f"{base_url}/models", timeout=30)
        assert refused.status_code == 401  # the gateway wants the client token
        reply = httpx.post(
            f"{base_url}/chat/completions",
            headers={"Authorization": f"Bearer {key.group(1)}"},
            json={"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4},
            timeout=60,
        )  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-dctl-version"] == "demo:v1"  # it went through the gateway
        engine = re.search(
            r"^Engine, bypassing the gateway: (http://127\.0\.0\.1:\d+/v1) \(API key (\S+)\)$",
            output,
            re.M,
        )
        assert engine and engine.group(1) != base_url, output
        direct = httpx.get(
            f"{engine.group(1)}/models",
            headers={"Authorization": f"Bearer {engine.group(2)}"},
            timeout=30,
        )
        assert direct.status_code == 200 and direct.json()["data"][0]["id"] == "demo"
        assert "dctl status" in output and "dctl tui" in output and "curl " in output
        try_lines = output.split("\nTry:\n", 1)[1].splitlines()
        rollout = [line.split("#")[0].strip() for line in try_lines[1:5]]
        assert rollout == [  # no --random: the trained model, whose v2 keeps v1's weights
            "dctl model create-demo ./demo-v2 --seed 2 && dctl model register demo:v2 ./demo-v2",
            "dctl rollout demo --to demo:v2 --canary 10% --wait",
            "dctl rollout status demo --watch",
            "dctl rollback demo",
        ], output
        assert "~1.5 min: 10% -> 50% -> 100%" in try_lines[2]
        assert "Demo traffic: 4 requests/s through the gateway" in output
        if os.geteuid() == 0:
            assert output.count("running as root") == 1
        _, contexts = CredentialsFile(credentials).load()
        assert contexts["demo"].url == "http://10.0.0.1:8700"  # never overwritten
        assert credentials.read_text().startswith(original)
        assert contexts["demo-2"].url == f"http://127.0.0.1:{port}"
        with ControlPlaneClient(f"http://127.0.0.1:{port}", contexts["demo-2"].token) as api:
            deployment = api.get_deployment("demo")
            # Room for a canary: two instances on the fake 2xH200 host, one GPU each.
            assert sorted(i.gpu_indices for i in deployment.instances) == [[0], [1]]
            assert {i.observed_state for i in deployment.instances} == {"ready"}
            assert deployment.engine_config["resources"]["threads"] == max(
                1, (os.cpu_count() or 1) // 2
            )
            assert deployment.rollout_policy.interval_s == 30
            assert deployment.rollout_policy.min_requests == 5

        def demo_requests_served() -> float:
            # The gateway's own counter: at once, where its reports reach the control plane
            # (which the rollout analysis reads) every 5 s.
            metrics = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=10).text
            served = sum(
                sample.value
                for family in text_string_to_metric_families(metrics)
                for sample in family.samples
                if sample.name == "dctl_gateway_requests_total"
                and sample.labels.get("deployment") == "demo"
                and sample.labels.get("code") == "200"
            )
            # More than this test and the demo's start-up probe sent themselves.
            return served if served >= 8 else 0

        wait_for("the demo traffic to reach the gateway", demo_requests_served, 20)
        assert _processes_mentioning(str(data_dir))  # server, agent and engines are running
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=90)
        reader.join(timeout=10)
    assert code == 0, "".join(lines)
    assert "stopping the demo" in "".join(lines)
    assert _processes_mentioning(str(data_dir)) == []


def _process_tree(root: int) -> dict[int, tuple[str, str]]:
    """ROOT's descendants now: pid -> (start time, command line)."""
    parents: dict[int, int] = {}
    seen: dict[int, tuple[str, str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        # After the command's name: state, ppid, ... and the start time, field 22 of stat(5).
        parents[int(proc.name)] = int(stat[1])
        seen[int(proc.name)] = (stat[19], cmdline)
    tree: dict[int, tuple[str, str]] = {}
    below = [root]
    while below:
        parent = below.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree[pid] = seen[pid]
                below.append(pid)
    return tree


def _still_running(recorded: dict[int, tuple[str, str]]) -> list[str]:
    """The command lines of RECORDED processes alive now (same pid and start time, no zombie)."""
    alive = []
    for pid, (started, cmdline) in recorded.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat[19] == started and stat[0] != "Z":
            alive.append(cmdline)
    return alive


def _demo_up(
    tmp_path: Path, stdout: int | IO[bytes], stderr: int | IO[bytes]
) -> subprocess.Popen[bytes]:
    """`dctl up --demo` on the tiny random checkpoint, in a throwaway home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_DATA_HOME=str(tmp_path))  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "up", "--demo", "--size", "tiny",
         "--data-dir", str(tmp_path / "demo-data"), "--port", str(free_port())],
        stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env,
    )  # fmt: skip


def _everything_it_started(
    up: subprocess.Popen[bytes], output: Callable[[], str]
) -> dict[int, tuple[str, str]]:
    """Wait until the demo is up; then every process it started, engines included."""
    deadline = time.monotonic() + 280
    while "Ctrl-C stops everything" not in output():
        assert up.poll() is None, output()
        assert time.monotonic() < deadline, output()
        time.sleep(0.5)
    tree = _process_tree(up.pid)
    commands = [cmdline for _, cmdline in tree.values()]
    for part in ("-m cli server", "-m cli agent", "-m cli gateway"):
        assert sum(part in c for c in commands) == 1, commands
    assert sum("-m engine.serve" in c for c in commands) >= 2, commands
    return tree


def _kill(recorded: dict[int, tuple[str, str]]) -> None:
    """Whatever a failed test left running must not load the machine for the next ones."""
    for pid in recorded:
        with contextlib.suppress(OSError):
            if _still_running({pid: recorded[pid]}):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
def test_ctrl_c_stops_everything_after_tee_died(tmp_path: Path) -> None:
    # `dctl up --demo | tee up.log`, then Ctrl-C: the terminal sends SIGINT to both, tee dies
    # first, and the demo's next line meets a pipe nobody reads.
    log, errors = tmp_path / "up.log", tmp_path / "up.err"
    with errors.open("wb") as err:
        up = _demo_up(tmp_path, subprocess.PIPE, err)
    tee = subprocess.Popen(["tee", str(log)], stdin=up.stdout, stdout=subprocess.DEVNULL)
    up.stdout.close()  # type: ignore[union-attr]  # tee is the pipe's only reader
    tree: dict[int, tuple[str, str]] = {}
    try:
        tree = _everything_it_started(up, lambda: log.read_text() if log.exists() else "")
        tee.send_signal(signal.SIGINT)
        tee.wait(timeout=30)
        up.send_signal(signal.SIGINT)
        code = up.wait(timeout=240)
    finally:
        up.kill()
        tee.kill()
        _kill(tree)
    problems = errors.read_text()
    assert code == 0, problems
    assert "Traceback" not in problems and "Exception ignored" not in problems, problems
    assert _still_running(tree) == []


@pytest.mark.timeout(600)
def test_a_hang_up_stops_everything_though_the_terminal_is_gone(tmp_path: Path) -> None:
    # Closing the terminal: SIGHUP, and the demo's stdout and stderr can no longer be written.
    terminal, demo_side = os.openpty()
    up = _demo_up(tmp_path, demo_side, demo_side)
    os.close(demo_side)
    shown = bytearray()

    def screen() -> str:
        while select.select([terminal], [], [], 0)[0]:
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # EIO: nothing holds the demo's side any more
                break
            if not chunk:
                break
            shown.extend(chunk)
        return shown.decode(errors="replace")

    tree: dict[int, tuple[str, str]] = {}
    try:
        tree = _everything_it_started(up, screen)
        os.close(terminal)
        up.send_signal(signal.SIGHUP)
        code = up.wait(timeout=240)
    finally:
        up.kill()
        _kill(tree)
    assert code == 0, shown.decode(errors="replace")
    assert _still_running(tree) == []


@pytest.mark.timeout(600)
def test_sigterm_stops_everything(tmp_path: Path) -> None:
    # A service manager or `kill`: SIGTERM to dctl up alone, its output going to a file.
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        up = _demo_up(tmp_path, out, subprocess.STDOUT)
    tree: dict[int, tuple[str, str]] = {}
    try:
        tree = _everything_it_started(up, log.read_text)
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=240)
    finally:
        up.kill()
        _kill(tree)
    shown = log.read_text()
    assert code == 0, shown
    assert "stopping the demo" in shown and "Traceback" not in shown, shown
    assert _still_running(tree) == []
