"""Requests for a deployment scaled to zero: held while the control plane is asked to wake it,
forwarded once a routing table lists an instance, a 503 to retry after `cold_start_timeout_s`.

A live gateway polls a stand-in control plane whose routing table the test changes, as the
control plane would once the woken instance is ready; a canned engine is that instance.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from client.errors import ClientError
from client.http import AsyncControlPlaneClient
from gateway import GatewaySettings
from protocol.gateway import RouteTable, TrafficAccepted, TrafficReport
from tests.gateway.canned_engine import CannedEngine
from tests.gateway.conftest import Fleet, LiveGateway, served, until

INSTANCE_ID = 100


class WakingControlPlane:
    """Stands in for the control plane's gateway endpoints: the routing table (the test sets its
    deployments), traffic reports taken, and wake calls recorded (the first FAILURES of them
    fail, and with GONE every one answers 404)."""

    def __init__(self, clients: list[dict[str, Any]]) -> None:
        self.clients = clients
        self.table: RouteTable | None = None
        self.wakes: list[str] = []
        self.failures = 0
        self.gone = False

    def set(self, *deployments: dict[str, Any]) -> None:
        """Serve a new table of DEPLOYMENTS (a new ETag)."""
        etag = f"cold-{time.monotonic_ns()}"
        table = {"etag": etag, "deployments": list(deployments), "clients": self.clients}
        self.table = RouteTable.model_validate(table)

    async def routes(self, etag: str | None = None) -> RouteTable | None:
        assert self.table is not None
        return None if etag == self.table.etag else self.table

    async def wake_deployment(self, name: str) -> None:
        self.wakes.append(name)
        if self.gone:
            raise ClientError(f"no deployment {name!r}", 404)
        if len(self.wakes) <= self.failures:
            raise ClientError("cannot reach the control plane at http://cp:8700")

    async def report_traffic(self, report: TrafficReport) -> TrafficAccepted:
        return TrafficAccepted(accepted=len(report.windows))

    async def aclose(self) -> None:
        pass


@pytest.fixture(scope="module")
def engine(fleet: Fleet) -> Iterator[CannedEngine]:
    """The instance a woken deployment gets."""
    engine = CannedEngine("woken")
    fleet.loop.run(engine.start())
    yield engine
    fleet.loop.run(engine.stop())


def deployment(name: str, timeout_s: float | None, *ready: CannedEngine) -> dict[str, Any]:
    """A routing-table deployment serving model `NAME-model`, with READY as its instances."""
    instances = [
        {"id": INSTANCE_ID, "host": "host-woken", "address": "127.0.0.1", "port": e.port,
         "api_key": "dctl_ik_woken"}
        for e in ready
    ]  # fmt: skip
    stable = {"version_id": 1, "version": f"{name}-model:v1", "instances": instances}
    return {"deployment": name, "model_names": [f"{name}-model"], "stable": stable,
            "cold_start_timeout_s": timeout_s}  # fmt: skip


@contextmanager
def cold_gateway(
    fleet: Fleet, *deployments: dict[str, Any], **settings: Any
) -> Iterator[tuple[LiveGateway, WakingControlPlane]]:
    """A gateway polling a stand-in control plane every 20 ms, its table DEPLOYMENTS."""
    clients = json.loads(fleet.routes_file.read_text())["clients"]
    link = WakingControlPlane(clients)
    link.set(*deployments)
    options = GatewaySettings(
        control_plane="http://cp.invalid:8700", token="dctl_gw_token", port=0,
        routes_poll_s=0.02, rate_limit_rps=0, **settings,
    )  # fmt: skip
    with served(options, fleet, control_plane=link) as live:
        until(lambda: live.http.get("/health/ready").status_code == 200)
        yield live, link


def _waiting(live: LiveGateway, name: str) -> float:
    return live.metrics().get(f"dctl_gateway_cold_start_waiting{{deployment={name}}}", 0.0)


def _waits(live: LiveGateway, name: str, outcome: str) -> float:
    key = f"dctl_gateway_cold_start_wait_seconds_count{{deployment={name},outcome={outcome}}}"
    return live.metrics().get(key, 0.0)


def _wake_calls(live: LiveGateway, name: str, result: str) -> float:
    key = f"dctl_gateway_wake_calls_total{{deployment={name},result={result}}}"
    return live.metrics().get(key, 0.0)


def test_held_requests_are_forwarded_once_an_instance_is_ready(
    fleet: Fleet, engine: CannedEngine
) -> None:
    with cold_gateway(fleet, deployment("sleepy", 10.0)) as (live, link):
        # A deployment scaled to zero can serve (by waking): the gateway is healthy.
        assert live.http.get("/health").status_code == 200
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(live.post, "sleepy-model") for _ in range(3)]
            until(lambda: _waiting(live, "sleepy") == 3 and bool(link.wakes))
            assert link.wakes == ["sleepy"], "one wake call for every request held"
            time.sleep(0.2)  # polls come and go; the requests wait on
            assert not any(a.done() for a in answers)
            link.set(deployment("sleepy", 10.0, engine))
            results = [a.result(timeout=5) for a in answers]
        for answer in results:
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-dctl-version"] == "sleepy-model:v1"
            assert answer.headers["x-dctl-instance"] == str(INSTANCE_ID)
            assert engine.seen(answer.headers["x-request-id"])
        assert link.wakes == ["sleepy"]
        assert _waiting(live, "sleepy") == 0
        assert _waits(live, "sleepy", "served") == 3
        assert _wake_calls(live, "sleepy", "accepted") == 1
        assert live.metrics()["dctl_gateway_inflight{}"] == 0
        # Ready now: the next request goes straight through, nothing held or woken.
        assert live.post("sleepy-model").status_code == 200
        assert _waits(live, "sleepy", "served") == 3 and link.wakes == ["sleepy"]


def test_past_its_timeout_a_held_request_is_told_to_retry(fleet: Fleet) -> None:
    with cold_gateway(fleet, deployment("sleepy", 0.5)) as (live, link):
        started = time.monotonic()
        answer = live.post("sleepy-model")
        waited = time.monotonic() - started
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "5"
    error = answer.json()["error"]
    assert error["code"] == "cold_start_timeout" and error["type"] == "service_unavailable"
    assert "starting from zero (scaled to zero)" in error["message"]
    assert "within 0.5 s" in error["message"] and "retry" in error["message"]
    assert 0.45 <= waited < 3.0
    assert link.wakes == ["sleepy"]


def test_metrics_count_the_timeout(fleet: Fleet) -> None:
    with cold_gateway(fleet, deployment("sleepy", 0.3)) as (live, _):
        for _ in range(2):
            assert live.post("sleepy-model").status_code == 503
        assert _waits(live, "sleepy", "timeout") == 2
        assert _waits(live, "sleepy", "served") == 0
        assert _waiting(live, "sleepy") == 0
        key = "dctl_gateway_cold_start_wait_seconds_sum{deployment=sleepy,outcome=timeout}"
        assert 0.55 <= live.metrics()[key] < 3.0  # two waits of 0.3 s (timers may fire ~1 ms early)


def test_a_deployment_that_does_not_scale_to_zero_is_refused_at_once(fleet: Fleet) -> None:
    with cold_gateway(fleet, deployment("empty", None)) as (live, link):
        # No instance and no scaling from zero: nothing can serve, as before.
        assert live.http.get("/health").status_code == 503
        assert live.http.get("/health/ready").status_code == 200
        started = time.monotonic()
        answer = live.post("empty-model")
        assert time.monotonic() - started < 0.5
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "no_instance"
        unknown = live.post("nowhere-model")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert link.wakes == []
        assert not any("cold_start_wait_seconds_count" in k for k in live.metrics())


def test_a_client_that_leaves_stops_waiting(fleet: Fleet) -> None:
    with cold_gateway(fleet, deployment("sleepy", 30.0)) as (live, _):
        body = json.dumps({"model": "sleepy-model", "prompt": "hi"}).encode()
        head = (
            "POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {fleet.tokens['full']}\r\ncontent-length: {len(body)}\r\n\r\n"
        )
        url = httpx.URL(live.url)
        assert url.port is not None
        with socket.create_connection((url.host, url.port)) as client:
            client.sendall(head.encode() + body)
            until(lambda: _waiting(live, "sleepy") == 1)
        until(lambda: _waiting(live, "sleepy") == 0)  # long before its 30 s
        metrics = live.metrics()
        assert metrics["dctl_gateway_inflight{}"] == 0
        assert _waits(live, "sleepy", "client_left") == 1
        assert metrics["dctl_gateway_requests_total{code=499,deployment=,pinned=,pool=,version=}"]
        assert live.gateway.app.cold_starts.held("sleepy") == 0


def test_held_requests_keep_their_in_flight_slots(fleet: Fleet) -> None:
    with (
        cold_gateway(fleet, deployment("sleepy", 1.5), max_inflight=2) as (live, _),
        ThreadPoolExecutor(2) as pool,
    ):
        capped = pool.submit(live.post, "sleepy-model", "capped")
        until(lambda: _waiting(live, "sleepy") == 1)
        # The token's one slot is held while it waits ...
        over = live.post("sleepy-model", "capped")
        assert over.status_code == 429
        assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
        other = pool.submit(live.post, "sleepy-model", "full")
        until(lambda: _waiting(live, "sleepy") == 2)
        # ... and so is the gateway's: two held requests fill max_inflight.
        full = live.post("sleepy-model", "full")
        assert full.status_code == 503 and full.json()["error"]["code"] == "overloaded"
        assert capped.result(5).status_code == 503 and other.result(5).status_code == 503


def test_failed_wake_calls_are_retried_without_failing_the_request(
    fleet: Fleet, engine: CannedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with cold_gateway(fleet, deployment("sleepy", 5.0)) as (live, link):
        link.failures = 2
        live.gateway.app.cold_starts.wake_interval_s = 0.05
        with (
            caplog.at_level(logging.INFO, logger="dctl.gateway.cold_start"),
            ThreadPoolExecutor(1) as pool,
        ):
            answer = pool.submit(live.post, "sleepy-model")
            until(lambda: _wake_calls(live, "sleepy", "accepted") >= 1)
            assert not answer.done()
            link.set(deployment("sleepy", 5.0, engine))
            assert answer.result(5).status_code == 200
        assert _wake_calls(live, "sleepy", "failed") == 2
        # One call at a time, one every interval while the request waited.
        assert set(link.wakes) == {"sleepy"} and len(link.wakes) >= 3
        messages = [r.getMessage() for r in caplog.records]
        (warning,) = [m for m in messages if "cannot wake deployment sleepy" in m]
        assert "retrying every 0.05 s" in warning and "http://cp:8700" in warning
        assert any("woken after 2 failed calls" in m for m in messages)


def test_a_deployment_removed_while_requests_wait_ends_their_wait(fleet: Fleet) -> None:
    with cold_gateway(fleet, deployment("sleepy", 10.0)) as (live, link):
        link.gone = True
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(live.post, "sleepy-model")
            until(lambda: _wake_calls(live, "sleepy", "gone") >= 1)
            link.set(deployment("other", None))
            gone = answer.result(5)
        assert gone.status_code == 404
        assert "was removed while this request waited" in gone.json()["error"]["message"]
        assert _waits(live, "sleepy", "gone") == 1
        assert _waiting(live, "sleepy") == 0


def test_the_control_plane_client_wakes_a_deployment() -> None:
    seen: list[httpx.Request] = []

    def control_plane(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/gone/wake"):
            return httpx.Response(404, json={"message": "no deployment 'gone'"})
        return httpx.Response(202)

    async def wake() -> ClientError:
        transport = httpx.MockTransport(control_plane)
        async with AsyncControlPlaneClient(
            "http://cp:8700", "dctl_gw_x", transport=transport
        ) as client:
            await client.wake_deployment("sleepy")
            with pytest.raises(ClientError) as gone:
                await client.wake_deployment("gone")
        return gone.value

    gone = asyncio.run(wake())
    assert gone.status == 404
    first = seen[0]
    assert (first.method, first.url.path) == ("POST", "/api/v1/deployments/sleepy/wake")
    assert first.headers["authorization"] == "Bearer dctl_gw_x"
