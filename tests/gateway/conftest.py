"""Gateways under real uvicorn servers on loopback, in front of canned engines.

One fleet of canned engines (`canned_engine.py`) and two gateways serve the whole session, both
from one static routes file: `gateway` with generous limits, and `strict` with tiny ones and
the pool header turned off. Each deployment in the table exists for one kind of test, so tests
that make instances fail (and get them ejected) do not disturb the others; each client token
likewise, so that rate buckets stay apart.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from client.errors import ClientError
from gateway import Gateway, GatewaySettings, build_gateway
from gateway.main import server_options
from protocol.gateway import TrafficAccepted, TrafficReport
from tests.gateway.canned_engine import CannedEngine, LoopThread, refused_port
from tests.uvicorn_thread import serve_in_thread

# name -> (instance id, mode)
ENGINES: dict[str, tuple[int, str]] = {
    "a": (1, "ok"), "b": (2, "ok"), "c": (3, "ok"), "d": (4, "ok"), "e": (5, "ok"),
    "f": (6, "503"), "g": (7, "ok"), "h": (8, "ok"), "i": (9, "ok"), "j": (10, "ok"),
    "k": (12, "ok"), "l": (13, "500"),
}  # fmt: skip
DEAD_ID = 11
# The routing table's version ids, by the MODEL:VERSION clients see in `x-dctl-version`.
VERSION_IDS = {
    "main-model:v1": 1, "main-model:v2": 2, "solo-model:v1": 3, "errors-model:v1": 4,
    "draining-model:v1": 5, "twice-model:v1": 6, "dead-model:v1": 7, "empty-model:v1": 8,
    "starved-model:v1": 9, "starved-model:v2": 10,
}  # fmt: skip
CLIENTS: dict[str, list[str] | None] = {
    "full": None, "scoped": ["solo"], "expired": None,
    "strict-inflight": None, "strict-burst": None, "strict-body": None, "strict-pool": None,
    "strict-timeout": None, "strict-other": None,
    "pinner": None, "strict-pinner": None, "capped": None, "many": None,
}  # fmt: skip
# What some client tokens are granted beyond their scope (`RouteClient` fields).
GRANTS: dict[str, dict[str, Any]] = {
    "pinner": {"allow_pool_pin": True}, "strict-pinner": {"allow_pool_pin": True},
    "capped": {"max_concurrency": 1}, "many": {"max_concurrency": 16},
}  # fmt: skip


def mint_token() -> tuple[str, str]:
    """A client token in the control plane's shape: (key id, secret)."""
    key_id = secrets.token_hex(6)
    return key_id, f"dctl_{key_id}_{secrets.token_urlsafe(32)}"


@dataclass
class Fleet:
    """The canned engines, the client tokens and the routes file that names them."""

    loop: LoopThread
    engines: dict[str, CannedEngine]
    tokens: dict[str, str]
    routes_file: Path


@dataclass
class LiveGateway:
    """A gateway app served by uvicorn on 127.0.0.1:`port`."""

    url: str
    gateway: Gateway
    fleet: Fleet
    http: httpx.Client = field(repr=False)

    def post(
        self, model: str, token: str | None = "full", *, path: str = "/v1/completions",
        headers: dict[str, str] | None = None, **body: Any,
    ) -> httpx.Response:  # fmt: skip
        """One completion request with client TOKEN (a name in CLIENTS, or None: no token)."""
        sent = dict(headers or {})
        if token is not None:
            sent["authorization"] = f"Bearer {self.fleet.tokens.get(token, token)}"
        return self.http.post(path, headers=sent, json={"model": model, "prompt": "hi", **body})

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{label=value,...}": value}."""
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}"] = s.value
        return samples


def _instance(name: str) -> dict[str, Any]:
    return {"id": ENGINES[name][0], "host": f"host-{name}", "address": "127.0.0.1",
            "port": 0, "api_key": f"dctl_ik_key-of-{name}"}  # fmt: skip


def routes_table(engines: dict[str, CannedEngine], tokens: dict[str, str]) -> dict[str, Any]:
    """The session's routing table."""

    def inst(name: str) -> dict[str, Any]:
        return {**_instance(name), "port": engines[name].port}

    def pool(version: str, *names: str) -> dict[str, Any]:
        return {"version_id": VERSION_IDS[version], "version": version,
                "instances": [inst(n) for n in names]}  # fmt: skip

    dead = {"id": DEAD_ID, "host": "host-dead", "address": "127.0.0.1", "port": refused_port(),
            "api_key": "dctl_ik_dead"}  # fmt: skip

    def deployment(name: str, stable: dict[str, Any], **more: Any) -> dict[str, Any]:
        models = more.pop("model_names", [f"{name}-model"])
        return {"deployment": name, "model_names": models, "stable": stable, **more}

    deployments = [
        deployment(
            "main", pool("main-model:v1", "a", "b"),
            canary=pool("main-model:v2", "c"), canary_weight=20,
        ),
        deployment("solo", pool("solo-model:v1", "d"), model_names=["solo-model", "solo-alias"]),
        deployment("errors", pool("errors-model:v1", "e")),
        deployment("draining", pool("draining-model:v1", "f", "g")),
        deployment("twice", pool("twice-model:v1", "h", "i")),
        deployment("dead", {**pool("dead-model:v1", "j"), "instances": [inst("j"), dead]}),
        deployment(  # a canary the gateway ejects: far less than its weight
            "starved", pool("starved-model:v1", "k"),
            canary=pool("starved-model:v2", "l"), canary_weight=50,
        ),
        deployment("empty", pool("empty-model:v1")),
    ]  # fmt: skip
    clients = []
    for name, scope in CLIENTS.items():
        secret = tokens[name]
        clients.append(
            {
                "key_id": secret.split("_")[1],
                "name": name,
                "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(),
                "deployments": scope,
                "expires_at": datetime(2000, 1, 1, tzinfo=UTC).isoformat()
                if name == "expired"
                else None,
                **GRANTS.get(name, {}),
            }
        )
    return {"etag": "test-1", "deployments": deployments, "clients": clients}


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The canned engines, running for the whole session."""
    loop = LoopThread()
    engines = {name: CannedEngine(name, mode) for name, (_, mode) in ENGINES.items()}
    for engine in engines.values():
        loop.run(engine.start())
    tokens = {name: mint_token()[1] for name in CLIENTS}
    routes_file = tmp_path_factory.mktemp("gateway") / "routes.json"
    routes_file.write_text(json.dumps(routes_table(engines, tokens)))
    yield Fleet(loop, engines, tokens, routes_file)
    for engine in engines.values():
        loop.run(engine.stop())
    loop.stop()


@contextmanager
def served(settings: GatewaySettings, fleet: Fleet, **wiring: Any) -> Iterator[LiveGateway]:
    """A gateway for SETTINGS (WIRING: `build_gateway`'s keywords), served by uvicorn in a
    thread until the block ends; then it stops as on SIGTERM (lifespan shutdown included)."""
    gateway = build_gateway(settings, **wiring)
    with (
        serve_in_thread(gateway.app, **server_options(settings)) as url,
        httpx.Client(base_url=url, timeout=30) as http,
    ):
        yield LiveGateway(url, gateway, fleet, http)


@pytest.fixture(scope="session")
def gateway(fleet: Fleet) -> Iterator[LiveGateway]:
    """The gateway with generous limits (no rate limit)."""
    settings = GatewaySettings(
        routes_file=fleet.routes_file, port=0, rate_limit_rps=0, upstream_timeout_s=10
    )
    with served(settings, fleet) as live:
        yield live


@pytest.fixture(scope="session")
def strict(fleet: Fleet) -> Iterator[LiveGateway]:
    """A gateway with tiny limits and the pool header turned off."""
    settings = GatewaySettings(
        routes_file=fleet.routes_file, port=0, pool_header=False, max_body_bytes=2048,
        max_inflight=2, rate_limit_rps=1, rate_limit_burst=3, upstream_timeout_s=1.0,
    )  # fmt: skip
    with served(settings, fleet) as live:
        yield live


class Sink:
    """Stands in for the control plane's `POST /api/v1/traffic`: keeps reports, or fails."""

    def __init__(self) -> None:
        self.reports: list[TrafficReport] = []
        self.fail_with: ClientError | None = None

    async def report_traffic(self, report: TrafficReport) -> TrafficAccepted:
        if self.fail_with is not None:
            raise self.fail_with
        self.reports.append(report)
        return TrafficAccepted(accepted=len(report.windows))


def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for CHECK to hold, failing the test past TIMEOUT_S."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
