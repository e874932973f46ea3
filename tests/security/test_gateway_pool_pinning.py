"""Threat: any client steers a rollout's verdict by pinning its requests to a pool.

`x-dctl-pool: stable|canary` chose the pool for every client token, and pinned requests went
into the traffic windows the rollout analysis compares: slow requests pinned to the canary and
fast ones to stable made the controller abort a healthy canary (the reverse can get a slow one
promoted).

Now pinning takes a grant: a client token created with `--allow-pool-pin`; any other gets a 403
that names the option. A pinned request is in no traffic window (its sender chose the version),
only in the gateway's metrics, with `pinned="true"`, so a smoke test stays visible.

Real parts: `dctl token create` against a real `dctl server` and a real `dctl gateway` process
that reads its routing table from it; canned engines behind a gateway served by uvicorn on
loopback for what the windows count.
"""

# Fixtures imported from tests/cli and tests/gateway are named again by the tests that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.tuning.grid import DecodeSetting
from engine.tuning.remote import HttpRunner, RemoteError
from gateway.traffic import WindowKey
from tests.cli.conftest import DCTL, Dctl, Server, dctl, free_port, server
from tests.gateway.conftest import ENGINES, VERSION_IDS, LiveGateway, fleet, gateway
from tests.security.gateway_process import gateway_serving

CANARY = ("main", VERSION_IDS["main-model:v2"], "canary")
STABLE = ("main", VERSION_IDS["main-model:v1"], "stable")


def _create(dctl: Dctl, name: str, *options: str) -> str:
    created = dctl("token", "create", name, *options)
    assert created.code == 0, created.stderr
    return created.stdout.strip()


@pytest.fixture
def gateway_process(server: Server, dctl: Dctl, tmp_path: Path) -> Iterator[str]:
    """`dctl gateway` reading routes from the session's `dctl server`; its base URL."""
    token_file = tmp_path / "gw.token"
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(_create(dctl, f"gw-{uuid.uuid4().hex[:6]}", "--role", "gateway"))
    port = free_port()
    argv = [*DCTL, "gateway", "--control-plane", server.url, "--token-file", str(token_file),
            "--port", str(port)]  # fmt: skip
    with gateway_serving(argv, server.env, port, tmp_path / "gateway.log") as url:
        yield url


def test_only_a_client_token_created_with_the_grant_may_pin_a_pool(
    server: Server, dctl: Dctl, gateway_process: str
) -> None:
    suffix = uuid.uuid4().hex[:6]
    ordinary = _create(dctl, f"app-{suffix}", "--role", "client")
    granted = _create(
        dctl, f"smoke-{suffix}", "--role", "client", "--allow-pool-pin", "--max-concurrency", "2"
    )
    listed = {t["name"]: t for t in json.loads(dctl("token", "list", "--json").stdout)}
    assert listed[f"smoke-{suffix}"]["allow_pool_pin"] is True
    assert listed[f"smoke-{suffix}"]["max_concurrency"] == 2
    assert listed[f"app-{suffix}"]["allow_pool_pin"] is False
    for role in ("viewer", "operator", "gateway"):
        wrong = dctl("token", "create", f"x-{suffix}", "--role", role, "--allow-pool-pin")
        assert wrong.code == 2 and "client tokens only" in wrong.stderr, wrong.stderr
    # The API itself refuses the grants on other roles (the CLI checked before sending).
    admin = {"authorization": f"Bearer {server.admin_token}"}
    for grant in ({"allow_pool_pin": True}, {"max_concurrency": 4}):
        body = {"name": f"y-{suffix}", "role": "operator", **grant}
        answer = httpx.post(f"{server.url}/api/v1/tokens", json=body, headers=admin, timeout=10)
        assert answer.status_code == 422 and "client tokens only" in answer.text, answer.text

    # The gateway polls routes every second: both tokens are there within a few polls.
    url = f"{gateway_process}/v1/completions"
    body = {"model": "no-such-model", "prompt": "hi"}

    def post(token: str, pool: str | None) -> httpx.Response:
        headers = {"authorization": f"Bearer {token}"} | ({"x-dctl-pool": pool} if pool else {})
        return httpx.post(url, json=body, headers=headers, timeout=10)

    deadline = time.monotonic() + 20
    while post(granted, None).status_code == 401 or post(ordinary, None).status_code == 401:
        assert time.monotonic() < deadline, "the new tokens never reached the gateway"
        time.sleep(0.1)

    for pool in ("canary", "stable"):
        refused = post(ordinary, pool)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert error["code"] == "pool_pin_not_allowed" and error["param"] == "x-dctl-pool"
        assert "--allow-pool-pin" in error["message"]
        # The granted token passes the pin check (and meets the unknown model next).
        assert post(granted, pool).status_code == 404
    assert post(ordinary, None).status_code == 404  # without the header it is served as ever


def _requests(gateway: LiveGateway, key: WindowKey) -> int:
    window = gateway.gateway.windows.peek(key)  # what the next traffic report carries
    return window.requests if window is not None else 0


def test_a_client_cannot_skew_the_canary_analysis_by_pinning(gateway: LiveGateway) -> None:
    before = {key: _requests(gateway, key) for key in (CANARY, STABLE)}
    # The attack: slow requests pinned to the canary (fast ones to stable would follow).
    request_id = "steer-" + uuid.uuid4().hex
    slow = {"canned": "slow", "chunks": 3, "delay": 0.05}
    refused = gateway.post(
        "main-model", "full", headers={"x-dctl-pool": "canary", "x-request-id": request_id}, **slow
    )
    assert refused.status_code == 403 and "--allow-pool-pin" in refused.json()["error"]["message"]
    assert not gateway.fleet.engines["c"].seen(request_id), "the canary never saw it"

    # A token with the grant pins (a smoke test), and the analysis never sees those requests.
    metrics_before = gateway.metrics()
    for _ in range(4):
        pinned = gateway.post("main-model", "pinner", headers={"x-dctl-pool": "canary"}, **slow)
        assert pinned.status_code == 200
        assert pinned.headers["x-dctl-instance"] == str(ENGINES["c"][0])
    assert gateway.post("main-model", "pinner", headers={"x-dctl-pool": "stable"}).is_success
    assert {key: _requests(gateway, key) for key in (CANARY, STABLE)} == before
    # ...but the gateway's metrics show them, apart.
    series = "code=200,deployment=main,pinned=true,pool=canary,version=main-model:v2"
    name = f"dctl_gateway_requests_total{{{series}}}"
    assert gateway.metrics()[name] == metrics_before.get(name, 0) + 4

    # Unpinned requests, the same token's too, count as ever.
    for _ in range(5):
        assert gateway.post("main-model", "pinner").status_code == 200
    after = sum(_requests(gateway, key) for key in (CANARY, STABLE))
    assert after == sum(before.values()) + 5


def test_tune_through_a_gateway_names_the_grant_it_needs(gateway: LiveGateway) -> None:
    setting = DecodeSetting(4, steps=4, reference=True)
    base_url = f"{gateway.url}/v1"
    tokens = gateway.fleet.tokens
    ordinary = HttpRunner(base_url, "solo-model", tokens["full"], ["hi"])
    with pytest.raises(RemoteError, match="--allow-pool-pin") as refused:
        ordinary.warm_up(setting)
    assert tokens["full"] not in str(refused.value)
    ordinary.close()
    granted = HttpRunner(base_url, "solo-model", tokens["pinner"], ["hi"])
    granted.warm_up(setting)  # pinned to stable, answered
    granted.close()
