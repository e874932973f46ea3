"""The REST client: every failure is one `ClientError` with the server's message and status, the
same for the sync and the async client; requests are data; the package stays light."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from client import calls
from client.errors import ClientError
from client.http import AsyncControlPlaneClient, ControlPlaneClient
from protocol.rest import TokenCreate
from tests.cli.conftest import Server, free_port

URL = "http://cp.test/"
Handler = Callable[[httpx.Request], httpx.Response]


def answering(**answer: Any) -> Handler:
    """A transport handler that answers every request with ANSWER."""
    return lambda request: httpx.Response(**answer)


@pytest.fixture(params=["sync", "async"])
def call(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """`call(handler, "endpoint", *args)`: the endpoint's result from the sync or async client.

    One `httpx.MockTransport` serves both clients, so every mapping test below runs twice.
    """

    def sync(handler: Handler, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        with ControlPlaneClient(URL, "dctl_k_s", transport=httpx.MockTransport(handler)) as api:
            return getattr(api, endpoint)(*args, **kwargs)

    def run_async(handler: Handler, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        async def go() -> Any:
            transport = httpx.MockTransport(handler)
            async with AsyncControlPlaneClient(URL, "dctl_k_s", transport=transport) as api:
                return await getattr(api, endpoint)(*args, **kwargs)

        return asyncio.run(go())

    return sync if request.param == "sync" else run_async


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"status_code": 403, "json": {"error": "forbidden", "message": "needs role admin"}},
         "needs role admin"),
        ({"status_code": 422, "json": {"detail": [{"loc": ["body", "name"], "msg": "too long"}]}},
         "name: too long"),
        ({"status_code": 404, "json": {"detail": "Not Found"}}, "Not Found"),
        ({"status_code": 502, "text": "<b>bad gateway</b>\nmore"}, "<b>bad gateway</b>"),
        ({"status_code": 500, "content": b""}, "Internal Server Error"),
    ],
)  # fmt: skip
def test_error_bodies_become_one_message_with_the_status(
    call: Callable[..., Any], answer: dict[str, Any], message: str
) -> None:
    with pytest.raises(ClientError) as info:
        call(answering(**answer), "list_hosts")
    assert info.value.message == message
    assert info.value.status == answer["status_code"]
    assert str(info.value) == f"{message} (HTTP {answer['status_code']})"


def test_the_token_is_sent_as_a_bearer_header_and_names_are_escaped(
    call: Callable[..., Any],
) -> None:
    seen: list[httpx.Request] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    assert call(respond, "delete_deployment", "a/b?c") is None
    assert seen[0].headers["Authorization"] == "Bearer dctl_k_s"
    assert seen[0].method == "DELETE"
    assert seen[0].url.raw_path == b"/api/v1/deployments/a%2Fb%3Fc"


def test_bodies_and_queries_go_out_as_the_call_describes(call: Callable[..., Any]) -> None:
    seen: list[httpx.Request] = []
    created = {
        "id": "k1", "name": "ci", "role": "operator", "host": None, "expires_at": None,
        "uses_left": None, "created_at": "2026-01-01T00:00:00Z", "created_by": "token:admin",
        "last_used_at": None, "revoked_at": None, "secret": "dctl_k1_x",
    }  # fmt: skip

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "POST":
            return httpx.Response(201, json=created)
        return httpx.Response(200, json={"items": [], "next_cursor": 7})

    token = call(respond, "create_token", TokenCreate(name="ci", role="operator"))
    assert token.secret == "dctl_k1_x" and token.role == "operator"
    # Only what was asked for is sent: a control plane without newer grants takes it.
    assert json.loads(seen[0].content) == {"name": "ci", "role": "operator"}
    page = call(respond, "list_events", after=3, kind="host")
    assert page.next_cursor == 7
    # Filters left as None are not sent at all.
    assert dict(seen[1].url.params) == {"after": "3", "kind": "host"}


def test_an_unreachable_server_is_a_client_error_without_status(call: Callable[..., Any]) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with pytest.raises(ClientError) as info:
        call(refuse, "status")
    assert info.value.status is None
    assert str(info.value).startswith("cannot reach the control plane at http://cp.test")
    assert "Connection refused" in str(info.value) and "dctl context list" in str(info.value)


def test_a_timeout_says_so(call: Callable[..., Any]) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(ClientError) as info:
        call(slow, "list_models")
    assert "did not answer in time" in str(info.value) and info.value.status is None


def test_a_redirect_is_not_followed_but_named(call: Callable[..., Any]) -> None:
    # Following it would hand the bearer token to whatever address the answer names.
    moved = answering(status_code=308, headers={"location": "https://cp.test/api/v1/status"})
    with pytest.raises(ClientError) as info:
        call(moved, "status")
    assert "redirects to https://cp.test/api/v1/status" in str(info.value)
    assert info.value.status == 308


def test_an_answer_of_another_shape_names_the_field(call: Callable[..., Any]) -> None:
    body = json.dumps([{"name": "h1"}]).encode()
    with pytest.raises(ClientError) as info:
        call(answering(status_code=200, content=body), "list_hosts")
    assert "0.id" in str(info.value) and "same dctl version" in str(info.value)


def test_non_json_success_is_an_error(call: Callable[..., Any]) -> None:
    with pytest.raises(ClientError) as info:
        call(answering(status_code=200, text="hello"), "status")
    assert "non-JSON" in str(info.value)


def test_raw_requests_return_the_decoded_json(call: Callable[..., Any]) -> None:
    assert call(answering(status_code=200, json={"ok": True}), "request", "GET", "/readyz") == {
        "ok": True
    }


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("localhost:8700", "must be http://HOST[:PORT]"),
        ("ftp://cp.test", "must be http://HOST[:PORT]"),
        ("http://[::1", "is not valid"),
    ],
)
def test_a_bad_url_is_refused_before_any_request(url: str, says: str) -> None:
    for client in (ControlPlaneClient, AsyncControlPlaneClient):
        with pytest.raises(ClientError, match=re.escape(says)):
            client(url)


def test_calls_are_data_built_once_for_both_clients() -> None:
    call = calls.get_version("my model", "v1/2")
    assert (call.method, call.path) == ("GET", "/api/v1/models/my%20model/versions/v1%2F2")
    assert calls.list_tokens().query() is None
    assert calls.list_tokens(include_revoked=True).query() == {"include_revoked": "true"}
    # The endpoints' docstrings are the clients' documentation.
    assert ControlPlaneClient.list_hosts.__doc__ == calls.list_hosts.__doc__
    assert AsyncControlPlaneClient(URL).get_host.__doc__ == calls.get_host.__doc__


def test_importing_the_client_loads_no_server_or_engine_package() -> None:
    probe = (
        "import sys, json, client, client.http, client.calls, client.credentials\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(result.stdout))
    assert "client" in loaded
    assert loaded & {"sqlmodel", "sqlalchemy", "fastapi", "torch"} == set()


# Against a real control plane on loopback ----------------------------------------------------


async def test_the_async_client_against_a_real_control_plane(server: Server) -> None:
    async with AsyncControlPlaneClient(server.url, server.admin_token) as api:
        assert (await api.healthz()) is not None
        # Several requests in flight at once over one connection pool.
        summary, hosts, tokens = await asyncio.gather(
            api.status(), api.list_hosts(), api.list_tokens()
        )
        assert summary.gpus >= 0 and isinstance(hosts, list)
        assert any(t.role == "admin" for t in tokens)
        created = await api.create_token(TokenCreate(name="async-viewer", role="viewer"))
        assert created.secret.startswith("dctl_")
        with pytest.raises(ClientError) as missing:
            await api.get_host("no-such-host")
        assert missing.value.status == 404 and "no-such-host" in missing.value.message
        revoked = await api.revoke_token("async-viewer")
        assert revoked.revoked_at is not None

    async with AsyncControlPlaneClient(server.url, created.secret) as stale:
        with pytest.raises(ClientError) as denied:
            await stale.status()
        assert denied.value.status == 401

    async with AsyncControlPlaneClient(server.url, "dctl_aaaaaaaaaaaa_" + "b" * 32) as viewer:
        with pytest.raises(ClientError) as unknown:
            await viewer.list_tokens()
        assert unknown.value.status == 401


async def test_the_async_client_names_a_closed_port() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with AsyncControlPlaneClient(url, timeout=2.0) as api:
        with pytest.raises(ClientError) as info:
            await api.status()
    assert info.value.status is None
    assert str(info.value).startswith(f"cannot reach the control plane at {url}")
