"""One real fleet for the gateway's end-to-end tests: `dctl server` (SQLite), `dctl agent` with
two fake GPUs running two engines of deployment `demo` (stable demo:v1 and a canary demo:v2 at
weight 20), and `dctl gateway` processes in front, all on loopback in a throwaway home."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from client.http import ControlPlaneClient
from protocol.gateway import CanarySet
from protocol.rest import DeploymentCreate, Placement, TokenCreate
from tests.agent_e2e.conftest import DCTL, Stack, boot_stack, free_port, stop_stack, wait_for

HOST = "gw-host"
CANARY_WEIGHT = 20


@dataclass
class Gateway:
    """A running `dctl gateway` process."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Fleet:
    """The stack plus what the gateway tests need."""

    stack: Stack
    gateway_token_file: Path
    client_token: str
    pinning_token: str = ""  # a client token created with --allow-pool-pin
    gateways: list[Gateway] = field(default_factory=list)

    @property
    def api(self) -> ControlPlaneClient:
        return self.stack.api

    def start_gateway(self, name: str) -> Gateway:
        port = free_port()
        argv = [*DCTL, "gateway", "--control-plane", self.stack.url,
                "--token-file", str(self.gateway_token_file), "--port", str(port)]  # fmt: skip
        # The per-token rate limit has its own tests (tests/gateway); here it would only throttle.
        env = {**self.stack.env, "DCTL_GATEWAY_REPORT_INTERVAL_S": "1",
               "DCTL_GATEWAY_RATE_LIMIT_RPS": "0"}  # fmt: skip
        proc = self.stack.spawn(name, argv, env)
        gateway = Gateway(proc, f"http://127.0.0.1:{port}", self.stack.logs / f"{name}.log")
        self.gateways.append(gateway)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited: {gateway.log.read_text()[-2000:]}")
            try:
                return httpx.get(f"{gateway.url}/health/ready", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(f"{name} to load its routes", ready, 60)
        return gateway

    def both_pools_ready(self) -> None:
        """Wait until the control plane reports a ready instance of each version."""

        def ready() -> bool:
            deployment = self.api.get_deployment("demo")
            versions = {i.version for i in deployment.instances if i.observed_state == "ready"}
            return versions == {"v1", "v2"}

        try:
            wait_for("a ready stable and canary instance", ready, 300)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.stack.diagnostics()}") from None


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    home = tmp_path_factory.mktemp("gwfleet")
    stack = boot_stack(home, HOST)
    api, env = stack.api, stack.env
    fleet = Fleet(stack, home / "gateway-token", "")
    try:
        for version, seed in (("v1", "0"), ("v2", "1")):
            path = home / f"ckpt-{version}"
            stack.dctl("model", "create-demo", str(path), "--random", "--seed", seed)
            stack.dctl("model", "register", f"demo:{version}", str(path))
        boot_token = api.create_token(TokenCreate(name="gw-boot", role="bootstrap", uses=1))
        stack.env = {**env, "DCTL_BOOTSTRAP_TOKEN": boot_token.secret}
        stack.start_agent()
        wait_for("the host to register", lambda: api.get_host(HOST), 120)
        api.create_deployment(
            DeploymentCreate(
                name="demo", model="demo", version="v1", placement=Placement(hosts=[HOST]),
                instances_per_host=2, gpus_per_instance=1,
                # fp32 and a short context: the fastest the tiny checkpoint runs on a CPU.
                engine_config={"service": {"max_concurrent_requests": 8, "max_queue": 64},
                               "model": {"dtype": "fp32", "max_seq_len": 512}},
            )
        )  # fmt: skip
        api.set_canary("demo", CanarySet(version="v2", weight=CANARY_WEIGHT, instances=1))
        gw_token = api.create_token(TokenCreate(name="gw", role="gateway")).secret
        fd = os.open(fleet.gateway_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(gw_token + "\n")
        fleet.client_token = api.create_token(TokenCreate(name="app", role="client")).secret
        fleet.pinning_token = api.create_token(
            TokenCreate(name="smoke", role="client", allow_pool_pin=True)
        ).secret
        fleet.both_pools_ready()
        fleet.start_gateway("gateway-1")
        yield fleet
    finally:
        for gateway in fleet.gateways:
            gateway.stop()
        stop_stack(stack)
