"""One real fleet for the rollout end-to-end tests: `dctl server` (SQLite), `dctl agent` with two
fake GPUs running two engines of deployment `demo` (tiny random checkpoint, three versions
registered), `dctl gateway` in front, and a steady trickle of client requests through it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol.rest import DeploymentCreate, Placement, TokenCreate
from tests.agent_e2e.conftest import DCTL, Stack, boot_stack, stop_stack, wait_for
from tests.gateway_e2e.conftest import Fleet

HOST = "ro-host"
# fp32 and a short context: the fastest the tiny checkpoint runs on a CPU; one thread per
# engine (two engines share two cores: torch's spinning threads would fight over them); steps
# mode with 2 steps per 4-token block, so a canary decoding with 4 is visibly slower.
BASE_CONFIG = {
    "service": {"max_concurrent_requests": 8, "max_queue": 64},
    "resources": {"threads": 1},
    "model": {"dtype": "fp32", "max_seq_len": 512, "steps": 2},
}
BODY = {"model": "demo", "prompt": "Hello", "max_tokens": 4}


@dataclass
class Answer:
    """One client request through the gateway."""

    time: float  # monotonic
    status: int
    version: str
    seconds: float = 0.0
    wall: float = 0.0  # time.time(), to compare with the control plane's timestamps


@dataclass
class Load:
    """Requests sent one after another by a few threads until stopped; every answer kept."""

    url: str
    token: str
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, threads: int = 3) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def since(self, start: float) -> list[Answer]:
        return [a for a in list(self.answers) if a.time >= start]

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(timeout=60, headers=headers) as http:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    response = http.post(f"{self.url}/v1/completions", json=BODY)
                    answer = Answer(
                        time.monotonic(), response.status_code,
                        response.headers.get("x-dctl-version", ""), time.monotonic() - sent,
                        time.time(),
                    )  # fmt: skip
                except httpx.HTTPError as exc:
                    answer = Answer(time.monotonic(), 0, type(exc).__name__)
                self.answers.append(answer)


@dataclass
class RolloutFleet:
    """The fleet, its gateway, a load generator and the CLI."""

    fleet: Fleet
    load: Load

    @property
    def api(self):  # type: ignore[no-untyped-def]
        return self.fleet.api

    def dctl(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        stack = self.fleet.stack
        env = {**stack.env, "DCTL_URL": stack.url, "DCTL_TOKEN": stack.token}
        return subprocess.run(
            [*DCTL, *args], capture_output=True, text=True, env=env, timeout=timeout
        )

    def all_ready(self, version: str, timeout_s: float = 180) -> None:
        """Wait until both instances run VERSION and are ready."""

        def ready() -> bool:
            instances = self.api.get_deployment("demo").instances
            return len(instances) == 2 and all(
                i.version == version and i.observed_state == "ready" and i.on_version
                for i in instances
            )

        try:
            wait_for(f"both instances ready on {version}", ready, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.fleet.stack.diagnostics()}") from None


# Module scope: the load stops with the module, not in the middle of other tests' logs.
@contextlib.contextmanager
def serving_fleet(
    home: Path,
    stack: Stack,
    register: Callable[[Stack], None],
    *,
    gpus_per_instance: int = 1,
    engine_config: dict[str, Any] = BASE_CONFIG,
    load_threads: int = 3,
    ready_timeout_s: float = 180,
    host: str = HOST,
) -> Iterator[RolloutFleet]:
    """A booted STACK made a serving fleet: REGISTER adds the model versions, then the agent
    registers, deployment `demo` runs demo:v1 on two instances, a gateway serves it and a load
    of LOAD_THREADS clients runs (HOST: the name STACK's agent registers); everything is
    stopped on the way out."""
    api, env = stack.api, stack.env
    fleet = Fleet(stack, home / "gateway-token", "")
    load = None
    try:
        register(stack)
        boot_token = api.create_token(TokenCreate(name="ro-boot", role="bootstrap", uses=1))
        stack.env = {**env, "DCTL_BOOTSTRAP_TOKEN": boot_token.secret}
        stack.start_agent()
        wait_for("the host to register", lambda: api.get_host(host), 120)
        api.create_deployment(
            DeploymentCreate(
                name="demo", model="demo", version="v1", placement=Placement(hosts=[host]),
                instances_per_host=2, gpus_per_instance=gpus_per_instance,
                engine_config=engine_config,
            )
        )  # fmt: skip
        gw_token = api.create_token(TokenCreate(name="gw", role="gateway")).secret
        fd = os.open(fleet.gateway_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(gw_token + "\n")
        fleet.client_token = api.create_token(TokenCreate(name="app", role="client")).secret
        ro = RolloutFleet(fleet, Load("", fleet.client_token))
        ro.all_ready("v1", timeout_s=ready_timeout_s)
        gateway = fleet.start_gateway("gateway-1")
        load = ro.load
        load.url = gateway.url
        load.start(threads=load_threads)
        yield ro
    finally:
        if load is not None:
            load.stop()
        for gateway in fleet.gateways:
            gateway.stop()
        stop_stack(stack)


@pytest.fixture(scope="module")
def rollout_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RolloutFleet]:
    home = tmp_path_factory.mktemp("rofleet")

    def register(stack: Stack) -> None:
        for version, seed in (("v1", "0"), ("v2", "1"), ("v3", "2")):
            path = home / f"ckpt-{version}"
            stack.dctl("model", "create-demo", str(path), "--random", "--seed", seed)
            stack.dctl("model", "register", f"demo:{version}", str(path))

    with serving_fleet(home, boot_stack(home, HOST), register) as ro:
        yield ro
