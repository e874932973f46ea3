"""The routing table gateways poll: ready instances only, ETag and 304, client token hashes (never
secrets), gateway-only access, a constant cost; and the REST client's gateway calls."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from client import calls
from client.errors import ClientError
from client.http import AsyncControlPlaneClient, ControlPlaneClient
from protocol.gateway import CanarySet, RouteTable, TrafficReport, TrafficWindow
from protocol.rollout_states import RolloutState
from tests.controlplane.conftest import Api, deploy, statements
from tests.controlplane.fleet import (
    ADDRESS,
    V2_DIGEST,
    beat,
    report,
    serving_fleet,
    version_id_of,
)

V = "/api/v1"


def routes(api: Api, token: str, **headers: str) -> httpx.Response:
    response: httpx.Response = api.call("GET", f"{V}/routes", token, headers=headers)
    return response


def table(api: Api, token: str) -> RouteTable:
    response = routes(api, token)
    assert response.status_code == 200, response.text
    return RouteTable.model_validate(response.json())


def test_ready_instances_are_listed_with_address_and_key_and_the_etag_tracks_changes(
    api: Api,
) -> None:
    agent = serving_fleet(api)
    gateway = api.token("gateway")
    empty = routes(api, gateway)
    assert empty.status_code == 200
    before = RouteTable.model_validate(empty.json())
    assert empty.headers["etag"] == f'"{before.etag}"'
    [web] = before.deployments
    assert (web.deployment, web.model_names, web.stable.version) == ("web", ["web"], "demo:v1")
    assert web.stable.version_id == version_id_of(api, "demo:v1")  # what windows report back
    assert web.stable.instances == [] and web.canary is None and web.canary_weight == 0

    desired = report(api, agent)
    after = table(api, gateway)
    assert after.etag != before.etag
    instances = after.deployments[0].stable.instances
    assert [(i.id, i.host, i.address, i.port, i.scheme) for i in instances] == [
        (d["instance_id"], "gpu-1", "10.0.0.5", d["port"], "http") for d in desired
    ]
    # The very key the agent starts the engine with.
    assert [i.api_key for i in instances] == [d["api_key"] for d in desired]

    # Unchanged: 304 without a body for the ETag as sent, bare, weak, or in a list.
    for header in (f'"{after.etag}"', after.etag, f'W/"{after.etag}"', f'"x", "{after.etag}"'):
        again = routes(api, gateway, **{"If-None-Match": header})
        assert again.status_code == 304, header
        assert again.content == b""
        assert again.headers["etag"] == f'"{after.etag}"'
    stale = routes(api, gateway, **{"If-None-Match": f'"{before.etag}"'})
    assert stale.status_code == 200 and stale.json()["etag"] == after.etag
    # The same store gives the same table and ETag, call after call (and replica after replica).
    assert table(api, gateway) == after


def test_only_instances_that_can_take_a_request_now_are_routed(api: Api) -> None:
    agent = serving_fleet(api)
    gateway = api.token("gateway")
    first, second = report(api, agent)
    assert len(table(api, gateway).deployments[0].stable.instances) == 2

    unhealthy = [{"instance_id": second["instance_id"], "state": "unhealthy"}]
    beat(api, agent, instances=unhealthy, advertise_address=ADDRESS)
    routed = table(api, gateway).deployments[0].stable.instances
    assert [i.id for i in routed] == [first["instance_id"]]

    # A draining host's instances leave at once (they are being stopped).
    assert api.as_admin("POST", f"{V}/hosts/gpu-1/drain").status_code == 200
    assert table(api, gateway).deployments[0].stable.instances == []
    assert api.as_admin("POST", f"{V}/hosts/gpu-1/undrain").status_code == 200
    report(api, agent)
    assert len(table(api, gateway).deployments[0].stable.instances) == 2

    # A silent host (not_ready) takes nothing, though its instances last said ready.
    api.clock.advance(30)
    api.app.state.ctx.health.sweep()
    assert api.as_admin("GET", f"{V}/hosts/gpu-1").json()["state"] == "not_ready"
    assert table(api, gateway).deployments[0].stable.instances == []

    # A heartbeat brings it back; engines serving HTTPS are reached with https://.
    beat(api, agent, facts={"engine_tls": True}, advertise_address=ADDRESS)
    assert [i.scheme for i in table(api, gateway).deployments[0].stable.instances] == [
        "https",
        "https",
    ]


def test_an_instance_of_a_host_without_an_address_is_left_out(api: Api) -> None:
    agent = serving_fleet(api, address=None)
    gateway = api.token("gateway")
    report(api, agent, address=None)
    shown = api.as_admin("GET", f"{V}/deployments/web").json()
    assert [i["observed_state"] for i in shown["instances"]] == ["ready", "ready"]
    assert table(api, gateway).deployments[0].stable.instances == []


def test_an_instance_still_running_another_version_is_not_in_the_pool(api: Api) -> None:
    agent = serving_fleet(api)
    gateway = api.token("gateway")
    first, second = report(api, agent)
    # Reported ready, but with the digest of another snapshot: its engine still serves that one.
    report(api, agent, **{str(first["instance_id"]): V2_DIGEST})
    routed = table(api, gateway).deployments[0].stable.instances
    assert [i.id for i in routed] == [second["instance_id"]]


def test_client_tokens_appear_as_hashes_while_they_work(api: Api) -> None:
    serving_fleet(api)
    gateway = api.token("gateway")
    created = api.as_admin(
        "POST", f"{V}/tokens", json={"name": "app", "role": "client", "deployments": ["web"]}
    )
    assert created.status_code == 201, created.text
    app = created.json()
    assert app["deployments"] == ["web"] and app["role"] == "client"
    anyone = api.token("client", name="anyone", expires_in_s=60)
    listed = {t["name"]: t for t in api.as_admin("GET", f"{V}/tokens").json()}
    assert listed["app"]["deployments"] == ["web"] and listed["anyone"]["deployments"] is None

    response = routes(api, gateway)
    clients = {c.name: c for c in RouteTable.model_validate(response.json()).clients}
    assert set(clients) == {"app", "anyone"}  # neither the gateway's nor the admin's token
    assert clients["app"].secret_sha256 == hashlib.sha256(app["secret"].encode()).hexdigest()
    assert clients["app"].key_id == app["id"] and clients["app"].deployments == ["web"]
    assert clients["anyone"].deployments is None
    assert clients["anyone"].expires_at == api.clock() + timedelta(seconds=60)
    for secret in (app["secret"], anyone):
        assert secret not in response.text
        assert secret.split("_", 2)[2] not in response.text

    etag = response.json()["etag"]
    assert api.as_admin("DELETE", f"{V}/tokens/app").status_code == 200
    revoked = table(api, gateway)
    assert revoked.etag != etag and [c.name for c in revoked.clients] == ["anyone"]
    api.clock.advance(61)
    assert table(api, gateway).clients == []


def test_client_token_deployments_must_exist_and_belong_to_client_tokens(api: Api) -> None:
    serving_fleet(api)

    def create(**body: Any) -> httpx.Response:
        response: httpx.Response = api.as_admin(
            "POST", f"{V}/tokens", json={"name": "app", "role": "client", **body}
        )
        return response

    missing = create(deployments=["web", "nope", "gone"])
    assert missing.status_code == 404
    assert missing.json()["message"] == "deployment(s) 'nope', 'gone' not found"
    viewer = create(role="viewer", deployments=["web"])
    assert viewer.status_code == 422 and "client tokens only" in viewer.json()["message"]
    assert create(deployments=[]).status_code == 422
    uses = create(uses=3)
    assert uses.status_code == 422 and "uses does not apply to client" in uses.json()["message"]
    repeated = create(deployments=["web", "web"])
    assert repeated.status_code == 201 and repeated.json()["deployments"] == ["web"]
    assert api.as_admin("GET", f"{V}/tokens").status_code == 200


def test_only_gateway_tokens_read_routes_and_they_read_nothing_else(api: Api) -> None:
    serving_fleet(api)
    gateway = api.token("gateway")
    client = api.token("client")
    for role in ("viewer", "operator", "admin", "client"):
        token = api.admin if role == "admin" else api.token(role)
        refused = routes(api, token)
        assert refused.status_code == 403, role
        assert "needs a token with role gateway" in refused.json()["message"]
    for token in (gateway, client):
        for method, path in [
            ("GET", f"{V}/hosts"),
            ("GET", f"{V}/deployments"),
            ("GET", f"{V}/deployments/web"),
            ("GET", f"{V}/deployments/web/traffic"),
            ("GET", f"{V}/models"),
            ("GET", f"{V}/events"),
            ("GET", f"{V}/tokens"),
            ("GET", f"{V}/status"),
            ("DELETE", f"{V}/deployments/web/canary"),
        ]:
            assert api.call(method, path, token).status_code == 403, (method, path)


def test_the_table_costs_the_same_queries_for_one_deployment_or_many(api: Api) -> None:
    agent = serving_fleet(api, per_host=1)
    gateway = api.token("gateway")
    report(api, agent)
    api.token("client")
    routes(api, gateway)  # the token's last-use write, once

    def cost() -> int:
        with statements(api) as seen:
            assert routes(api, gateway).status_code == 200
        return len(seen)

    small = cost()
    for name in ("api", "chat", "batch"):
        assert deploy(api, name, ["gpu-1"], per_host=2).status_code == 201
    assert api.as_admin(
        "PUT", f"{V}/deployments/chat/canary", json={"version": "v2", "weight": 10}
    ).is_success
    report(api, agent)
    for n in range(3):
        api.token("client", name=f"app-{n}")
    big = table(api, gateway)
    assert sum(len(d.stable.instances) for d in big.deployments) == 6
    assert cost() == small


def test_the_rest_client_speaks_every_gateway_call(api: Api) -> None:
    agent = serving_fleet(api)
    gateway, operator = api.token("gateway"), api.token("operator")

    def forward(request: httpx.Request) -> httpx.Response:
        # The sync client reaches the app through the test client (a real ASGI round trip).
        answer = api.client.request(
            request.method,
            request.url.raw_path.decode(),
            headers={k: v for k, v in request.headers.items() if k != "host"},
            content=request.content,
        )
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    seen: list[httpx.Request] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return forward(request)

    transport = httpx.MockTransport(recording)
    with ControlPlaneClient("http://cp.test", gateway, transport=transport) as gw:
        first = gw.routes()
        assert first is not None and first.deployments[0].deployment == "web"
        assert "if-none-match" not in seen[-1].headers
        assert gw.routes(first.etag) is None
        assert seen[-1].headers["if-none-match"] == f'"{first.etag}"'
        report(api, agent)
        changed = gw.routes(first.etag)
        assert changed is not None and changed.etag != first.etag
        now = api.clock()
        stable = first.deployments[0].stable.version_id
        accepted = gw.report_traffic(
            TrafficReport(
                gateway="gw-1",
                started_at=now - timedelta(seconds=5),
                ended_at=now,
                windows=[
                    TrafficWindow(deployment="web", version_id=stable, pool="stable", requests=3),
                    TrafficWindow(deployment="gone", version_id=stable, pool="stable"),
                ],
            )
        )
        assert (accepted.accepted, accepted.skipped) == (1, [f"gone version {stable}"])
        with pytest.raises(ClientError) as refused:
            gw.set_canary("web", CanarySet(version="v2", weight=10))
        assert refused.value.status == 403

    with ControlPlaneClient("http://cp.test", operator, transport=transport) as op:
        canary = op.set_canary("web", CanarySet(version="v2", weight=25, instances=1))
        assert (canary.canary, canary.weight, canary.instances) == ("demo:v2", 25, 1)
        since = api.clock() - timedelta(minutes=1)
        traffic = op.deployment_traffic("web", since=since, step_s=30)
        query = seen[-1].url.params
        assert query["since"] == since.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"
        assert query["step_s"] == "30" and "until" not in query
        assert traffic.since == since and traffic.step_s == 30
        assert [v.requests for v in traffic.versions] == [3]
        ended = op.clear_canary("web")
        assert (ended.state, ended.weight) == (RolloutState.ROLLED_BACK, 0)

    async def run_async() -> None:
        # The async client straight on the ASGI app.
        async with AsyncControlPlaneClient(
            "http://cp.test", gateway, transport=httpx.ASGITransport(app=api.app)
        ) as gw:
            latest = await gw.routes()
            assert latest is not None
            assert await gw.routes(latest.etag) is None

    asyncio.run(run_async())


def test_calls_describe_the_gateway_requests() -> None:
    until = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    call = calls.deployment_traffic("web", until=until, step_s=5)
    assert (call.method, call.path) == ("GET", "/api/v1/deployments/web/traffic")
    assert call.query() == {"until": "2026-01-01T12:00:00Z", "step_s": 5}
    assert calls.routes().headers == {} and calls.routes("abc").headers == {
        "If-None-Match": '"abc"'
    }
    assert calls.clear_canary("web").method == "DELETE"
