"""The client maps every failure to one `ClientError` carrying the server's message and status."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from client.http import ClientError, ControlPlaneClient


def client_answering(
    handler: httpx.MockTransport | None = None, **answer: object
) -> ControlPlaneClient:
    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(**answer)  # type: ignore[arg-type]

    return ControlPlaneClient(
        "http://cp.test/", "dctl_k_s", transport=handler or httpx.MockTransport(respond)
    )


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
    answer: dict[str, Any], message: str
) -> None:
    with client_answering(**answer) as api, pytest.raises(ClientError) as info:
        api.list_hosts()
    assert info.value.message == message
    assert info.value.status == answer["status_code"]
    assert str(info.value) == f"{message} (HTTP {answer['status_code']})"


def test_the_token_is_sent_as_a_bearer_header_and_names_are_escaped() -> None:
    seen: list[httpx.Request] = []

    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    with client_answering(httpx.MockTransport(respond)) as api:
        api.delete_deployment("a/b?c")
    assert seen[0].headers["Authorization"] == "Bearer dctl_k_s"
    assert seen[0].url.raw_path == b"/api/v1/deployments/a%2Fb%3Fc"


def test_an_unreachable_server_is_a_client_error_without_status() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with client_answering(httpx.MockTransport(refuse)) as api, pytest.raises(ClientError) as info:
        api.status()
    assert info.value.status is None
    assert str(info.value).startswith("cannot reach the control plane at http://cp.test")


def test_a_timeout_says_so() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with client_answering(httpx.MockTransport(slow)) as api, pytest.raises(ClientError) as info:
        api.list_models()
    assert "did not answer in time" in str(info.value)


def test_an_answer_of_another_shape_names_the_field() -> None:
    body = json.dumps([{"name": "h1"}]).encode()
    with client_answering(status_code=200, content=body) as api, pytest.raises(ClientError) as info:
        api.list_hosts()
    assert "0.id" in str(info.value) and "same dctl version" in str(info.value)


def test_non_json_success_is_an_error() -> None:
    with client_answering(status_code=200, text="hello") as api, pytest.raises(ClientError) as info:
        api.status()
    assert "non-JSON" in str(info.value)
