"""Logs from one place, on a real stack: `dctl server`, `dctl agent` (fake GPUs) running two
engines of the tiny checkpoint, `dctl gateway`, and the `dctl logs` CLI.

A line an engine writes reaches `dctl logs` within seconds; `--follow` sees new ones; a secret
in a line is redacted on the agent before it leaves the host; the gateway's request id is found
in the engine's log with `--request`; a control plane that is away loses none of the lines the
agent buffered, and the agent's bound is reported as drops when it overflows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from protocol.logs import LogPage
from tests.agent_e2e.conftest import DCTL, Stack, boot_stack, wait_for
from tests.rollout_e2e.conftest import BASE_CONFIG, RolloutFleet, serving_fleet

HOST = "logs-host"
BODY = {"model": "demo", "prompt": "Hello", "max_tokens": 4}
SECRET = "dctl_k9_" + "S" * 40


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutFleet]:
    home = tmp_path_factory.mktemp("logsfleet")
    stack = boot_stack(home, HOST)
    # The smallest buffer the agent takes (one heartbeat's batch), so an outage overflows it.
    stack.agent_args += ["--log-buffer-lines", "2000"]

    def register(s: Stack) -> None:
        path = home / "ckpt"
        s.dctl("model", "create-demo", str(path), "--random", "--seed", "0")
        s.dctl("model", "register", "demo:v1", str(path))

    with serving_fleet(home, stack, register, engine_config=BASE_CONFIG, load_threads=0,
                       host=HOST) as ro:  # fmt: skip
        yield ro


def engine_log(ro: RolloutFleet, instance_id: int) -> Path:
    return ro.fleet.stack.agent_data() / "agent" / "run" / "logs" / f"instance-{instance_id}.log"


def append(path: Path, *lines: str) -> None:
    """Lines as the engine writes them: appended to its log file."""
    with path.open("a") as handle:
        handle.write("".join(f"{line}\n" for line in lines))


def page(ro: RolloutFleet, **filters: object) -> LogPage:
    found: LogPage = ro.api.deployment_logs("demo", since=None, limit=10_000, **filters)
    return found


def dctl_logs(ro: RolloutFleet, *args: str) -> subprocess.CompletedProcess[str]:
    return ro.dctl("logs", "demo", *args, timeout=60)


def test_a_line_reaches_dctl_logs_within_seconds_redacted(fleet: RolloutFleet) -> None:
    ro = fleet
    first = ro.api.get_deployment("demo").instances[0].id
    marker = f"marker-{uuid.uuid4().hex[:8]}"
    written = time.monotonic()
    append(engine_log(ro, first), f"INFO {marker} Authorization: Bearer {SECRET}")
    wait_for("the line in dctl logs", lambda: marker in dctl_logs(ro, "--grep", marker).stdout, 5)
    took = time.monotonic() - written
    shown = dctl_logs(ro, "--grep", marker)
    assert shown.returncode == 0, shown.stderr
    assert f"{HOST} i{first} |" in shown.stdout
    assert SECRET not in shown.stdout and "Authorization: ***" in shown.stdout
    print(f"\nlogs e2e: a line in dctl logs {took:.2f}s after the engine wrote it")


def test_the_gateways_request_id_is_in_the_engines_log(fleet: RolloutFleet) -> None:
    ro = fleet
    request_id = f"e2e-{uuid.uuid4().hex[:12]}"
    headers = {"Authorization": f"Bearer {ro.fleet.client_token}", "x-request-id": request_id}
    answer = httpx.post(f"{ro.load.url}/v1/completions", json=BODY, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-request-id"] == request_id
    wait_for("the request in the engine's log", lambda: page(ro, request=request_id).items, 10)
    # The gateway's summary of it too, reported with its traffic (the client token's name).
    [summary] = wait_for(
        "the gateway's summary", lambda: ro.api.deployment_requests("demo", request=request_id), 10
    )
    assert (summary.token, summary.status, summary.pool) == ("app", 200, "stable")
    assert summary.completion_tokens is not None and summary.tokens_per_forward is not None
    shown = dctl_logs(ro, "--request", request_id)
    assert shown.returncode == 0, shown.stderr
    assert request_id in shown.stdout and "engine.requests" in shown.stdout


def test_follow_sees_new_lines_and_ctrl_c_exits_0(fleet: RolloutFleet) -> None:
    ro = fleet
    stack = ro.fleet.stack
    env = {**stack.env, "DCTL_URL": stack.url, "DCTL_TOKEN": stack.token}
    follower = subprocess.Popen(
        [*DCTL, "logs", "demo", "--follow", "--json", "--since", "1m"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        time.sleep(3)  # the history printed, the stream open
        marker = f"follow-{uuid.uuid4().hex[:8]}"
        append(engine_log(ro, ro.api.get_deployment("demo").instances[0].id), f"INFO {marker}")
        assert follower.stdout is not None
        deadline = time.monotonic() + 15
        seen = False
        while time.monotonic() < deadline and not seen:
            line = follower.stdout.readline()
            seen = bool(line) and json.loads(line)["line"].endswith(marker)
        assert seen, "the followed stream never showed the new line"
    finally:
        follower.send_signal(signal.SIGINT)
        code = follower.wait(timeout=15)
    assert code == 0


def test_an_outage_loses_nothing_within_the_bound_and_counts_the_rest(fleet: RolloutFleet) -> None:
    ro = fleet
    stack = ro.fleet.stack
    log = engine_log(ro, ro.api.get_deployment("demo").instances[0].id)
    tag = uuid.uuid4().hex[:6]
    stack.stop_server()
    down = time.monotonic()
    try:
        # Within the bound: 1500 lines; then past it: 3000 more (the buffer holds 2000).
        append(log, *(f"INFO outage-{tag} kept {n:05d}" for n in range(1500)))
        time.sleep(3)  # the agent reads them into its buffer, heartbeats fail
        append(log, *(f"INFO outage-{tag} over {n:05d}" for n in range(3000)))
        time.sleep(max(0.0, 60 - (time.monotonic() - down)))  # a minute away
    finally:
        stack.start_server()
    wait_for(
        "the buffered lines",
        lambda: len(page(ro, grep=f"outage-{tag} kept").items) == 1500,
        60,
    )
    kept = [e.line for e in page(ro, grep=f"outage-{tag} kept").items]
    assert [line.rsplit(" ", 1)[1] for line in kept] == [f"{n:05d}" for n in range(1500)]
    over = page(ro, grep=f"outage-{tag} over").items
    dropped = page(ro, agent=True).dropped
    assert dropped > 0, "an overflow must be reported as drops"
    assert len(over) + dropped >= 3000 - 100  # what arrived and what was counted (±a batch)
    assert os.path.getsize(log) > 0
