"""A real Prometheus (Debian's `prometheus`, 2.42) scraping a real stack on loopback.

The stack is one fleet for the whole session: `dctl server` (SQLite), `dctl agent` with two fake
GPUs running one engine of deployment `demo` (tiny demo checkpoint), and `dctl gateway` in
front; once traffic has been scraped, a rollout of `demo` is started and paused at once.
Prometheus runs with `monitoring/prometheus/prometheus.yml` and `alerts.yml` as shipped, a 1 s
scrape interval and a `file_sd` targets file this fixture writes itself with the labels
`dctl metrics targets` attaches (role, host, deployment, version, instance_id).

`promtool` / `prometheus` come from `.ci/run` (apt-get); without them these tests skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from client import ControlPlaneClient
from protocol.rest import DeploymentCreate, Placement, TokenCreate
from protocol.rollout_states import RolloutState
from protocol.rollouts import RolloutAction, RolloutCreate
from tests.agent_e2e.conftest import DCTL, Stack, boot_stack, free_port, stop_stack, wait_for
from tests.gateway_e2e.conftest import Gateway

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "monitoring" / "prometheus"
HOST = "obs-host"
# The labels below are the ones `dctl metrics targets` writes: engines get `version`
# MODEL:VERSION, gateways no deployment or version (their series carry their own).
GATEWAY_HOST = "127.0.0.1"
SCRAPE_INTERVAL = "1s"
# Each client token may send this many requests at once, then one every 1000 s: the second
# token's extra requests are the stack's 429s.
RATE_LIMIT_BURST = 4
COMPLETIONS = 4


def promtool_or_skip() -> str:
    """The path of `promtool`; skip (saying why) where the package is not installed."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed: apt-get install -y prometheus (.ci/run does)")
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    """Debian's promtool."""
    return promtool_or_skip()


@dataclass
class Prometheus:
    """A running Prometheus server and its HTTP API."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Evaluate EXPR now; the result's series (`metric`, `value`). Errors raise."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"{expr!r}: {body.get('errorType')}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def api(self, path: str) -> Any:
        """GET /api/v1/PATH's data."""
        body = httpx.get(f"{self.url}/api/v1/{path}", timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class ObservedStack:
    """The stack, its gateway and the Prometheus scraping them."""

    stack: Stack
    gateway: Gateway
    prometheus: Prometheus
    targets: list[dict[str, Any]]


def start_prometheus(home: Path, targets: list[dict[str, Any]]) -> Prometheus:
    """Prometheus with the shipped config and rules, scraping TARGETS every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed: apt-get install -y prometheus (.ci/run does)")
    work = home / "prometheus"
    work.mkdir()
    # Written once before start, then only ever replaced atomically (as `--watch` does).
    (work / "targets.json").write_text(json.dumps(targets, indent=2))
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=SCRAPE_INTERVAL, evaluation_interval=SCRAPE_INTERVAL)
    config["rule_files"] = [str(PROMETHEUS_DIR / "alerts.yml")]
    [job] = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(work / "targets.json")], "refresh_interval": "5s"}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = work / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
             "--storage.tsdb.retention.time=1h"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    server = Prometheus(proc, f"http://127.0.0.1:{port}", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{server.url}/-/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for("Prometheus to be ready", ready, 60)
    return server


def start_gateway(stack: Stack, token_file: Path) -> Gateway:
    """`dctl gateway` with a tiny per-token rate limit (so 429s are cheap to cause)."""
    port = free_port()
    argv = [*DCTL, "gateway", "--control-plane", stack.url, "--token-file", str(token_file),
            "--port", str(port)]  # fmt: skip
    env = {**stack.env, "DCTL_GATEWAY_REPORT_INTERVAL_S": "1",
           "DCTL_GATEWAY_RATE_LIMIT_RPS": "0.001",
           "DCTL_GATEWAY_RATE_LIMIT_BURST": str(RATE_LIMIT_BURST)}  # fmt: skip
    proc = stack.spawn("gateway", argv, env)
    gateway = Gateway(proc, f"http://127.0.0.1:{port}", stack.logs / "gateway.log")

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited: {gateway.log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{gateway.url}/health/ready", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for("the gateway to load its routes", ready, 60)
    return gateway


def send_traffic(gateway: Gateway, app_token: str, burst_token: str) -> None:
    """Completions that fill the engine's and the gateway's histograms, then refusals: 404s
    for an unknown model until BURST_TOKEN's bucket is empty, then 429s."""
    with httpx.Client(timeout=120) as http:
        for i in range(COMPLETIONS):
            response = http.post(
                f"{gateway.url}/v1/completions",
                json={"model": "demo", "prompt": f"Once {i}", "max_tokens": 8},
                headers={"Authorization": f"Bearer {app_token}"},
            )
            assert response.status_code == 200, response.text
        codes = [
            http.post(
                f"{gateway.url}/v1/completions",
                json={"model": "no-such-model", "prompt": "x", "max_tokens": 1},
                headers={"Authorization": f"Bearer {burst_token}"},
            ).status_code
            for _ in range(RATE_LIMIT_BURST + 2)
        ]
        assert 429 in codes, codes


@pytest.fixture(scope="session")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedStack]:
    """The whole fleet scraped by Prometheus, after some traffic has been scraped."""
    promtool_or_skip()
    home = tmp_path_factory.mktemp("observed")
    stack = boot_stack(home, HOST)
    agent_metrics_port = free_port()
    args = stack.agent_args
    args[args.index("--metrics-port") + 1] = str(agent_metrics_port)
    gateway: Gateway | None = None
    prometheus: Prometheus | None = None
    try:
        api = stack.api
        checkpoint = home / "ckpt"
        stack.dctl("model", "create-demo", str(checkpoint), "--random", "--seed", "0")
        stack.dctl("model", "register", "demo:v1", str(checkpoint))
        boot = api.create_token(TokenCreate(name="obs-boot", role="bootstrap", uses=1)).secret
        stack.env = {**stack.env, "DCTL_BOOTSTRAP_TOKEN": boot}
        stack.start_agent()
        wait_for("the host to register", lambda: api.get_host(HOST), 120)
        api.create_deployment(
            DeploymentCreate(
                name="demo", model="demo", version="v1", placement=Placement(hosts=[HOST]),
                instances_per_host=1, gpus_per_instance=1,
                engine_config={"model": {"dtype": "fp32", "max_seq_len": 512}},
            )
        )  # fmt: skip
        token_file = home / "gateway-token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(api.create_token(TokenCreate(name="gw", role="gateway")).secret + "\n")
        app_token = api.create_token(TokenCreate(name="app", role="client")).secret
        burst_token = api.create_token(TokenCreate(name="burst", role="client")).secret
        instance = stack.ready_instance()
        gateway = start_gateway(stack, token_file)
        targets = [
            {"targets": [f"127.0.0.1:{stack.server_port}"], "labels": {"role": "controlplane"}},
            {"targets": [f"127.0.0.1:{agent_metrics_port}"],
             "labels": {"role": "agent", "host": HOST}},
            {"targets": [f"127.0.0.1:{instance.port}"],
             "labels": {"role": "engine", "host": HOST, "deployment": instance.deployment,
                        "version": f"demo:{instance.version}", "instance_id": str(instance.id)}},
            {"targets": [gateway.url.removeprefix("http://")],
             "labels": {"role": "gateway", "host": GATEWAY_HOST}},
        ]  # fmt: skip
        prometheus = prom = start_prometheus(home, targets)
        wait_for("every target to be scraped", lambda: all_up(prom, len(targets)), 60)
        send_traffic(gateway, app_token, burst_token)
        # Two more scrapes after the traffic, so rates over it are not zero.
        wait_for(
            "the traffic to be scraped",
            lambda: (
                prom.query('dctl_gateway_requests_total{code="429"}')
                and prom.query(f"sum(dllm_requests_finished_total) >= {COMPLETIONS}")
            ),
            30,
        )
        hold_a_paused_rollout(api)
        wait_for(
            "the paused rollout to be scraped",
            lambda: prom.query(f'dctl_rollout_info{{state="{RolloutState.PAUSED}"}}'),
            30,
        )
        time.sleep(2.5)
        yield ObservedStack(stack, gateway, prom, targets)
    finally:
        if prometheus is not None:
            prometheus.stop()
        if gateway is not None:
            gateway.stop()
        stop_stack(stack)


def hold_a_paused_rollout(api: ControlPlaneClient) -> None:
    """A rollout of `demo` paused as soon as it starts, so the rollout gauges have series (and
    the alert on a long pause something to select): a new engine config on a surge instance
    (the second GPU), so the instance serving the traffic is never touched, and paused before
    its canary takes any."""
    config = {"model": {"dtype": "fp32", "max_seq_len": 256}}
    api.start_rollout("demo", RolloutCreate(engine_config=config, surge=1, reason="observed"))
    api.rollout_action("demo", "pause", RolloutAction(reason="held for the dashboard's queries"))


def all_up(prometheus: Prometheus, count: int) -> bool:
    """Whether COUNT targets have been scraped, all successfully."""
    active = prometheus.api("targets?state=active")["activeTargets"]
    return len(active) == count and all(t["health"] == "up" for t in active)
