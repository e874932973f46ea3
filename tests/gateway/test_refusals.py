"""What the gateway refuses, and how: each refusal in OpenAI's error shape with its status."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from tests.gateway.conftest import VERSION_IDS, LiveGateway


def _error(answer: httpx.Response, status: int) -> dict[str, object]:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "x-request-id" in answer.headers
    return dict(error)


def test_a_missing_malformed_unknown_or_expired_token_is_a_401(gateway: LiveGateway) -> None:
    assert "missing API key" in str(_error(gateway.post("solo-model", token=None), 401)["message"])
    basic = gateway.post("solo-model", headers={"authorization": "Basic abc"}, token=None)
    assert "malformed" in str(_error(basic, 401)["message"])
    for wrong in (
        "dctl_000000000000_" + "x" * 30,
        "sk-not-ours",
        gateway.fleet.tokens["full"] + "x",
    ):
        assert _error(gateway.post("solo-model", token=wrong), 401)["code"] == "invalid_api_key"
    assert "expired" in str(_error(gateway.post("solo-model", token="expired"), 401)["message"])
    # /v1/models wants a token too.
    assert gateway.http.get("/v1/models").status_code == 401


def test_a_scoped_token_sees_and_uses_only_its_deployments(gateway: LiveGateway) -> None:
    assert gateway.post("solo-model", token="scoped").status_code == 200
    error = _error(gateway.post("main-model", token="scoped"), 403)
    assert error["type"] == "permission_error" and "may not use deployment main" in str(
        error["message"]
    )
    unknown = _error(gateway.post("gpt-4", token="scoped"), 404)
    assert unknown["code"] == "model_not_found"
    assert "solo-alias, solo-model" in str(unknown["message"])
    assert "main-model" not in str(unknown["message"])
    headers = {"authorization": f"Bearer {gateway.fleet.tokens['scoped']}"}
    models = gateway.http.get("/v1/models", headers=headers).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["solo-alias", "solo-model"]


def test_an_unknown_model_lists_what_exists(gateway: LiveGateway) -> None:
    error = _error(gateway.post("nope"), 404)
    assert error["param"] == "model"
    assert "main-model" in str(error["message"]) and "solo-model" in str(error["message"])


def test_a_body_that_is_not_json_or_names_no_model_is_a_400(gateway: LiveGateway) -> None:
    headers = {"authorization": f"Bearer {gateway.fleet.tokens['full']}"}
    answer = gateway.http.post("/v1/completions", headers=headers, content=b"{nope")
    assert _error(answer, 400)["code"] == "invalid_json"
    answer = gateway.http.post("/v1/completions", headers=headers, json={"prompt": "hi"})
    assert _error(answer, 400)["param"] == "model"
    answer = gateway.http.post("/v1/completions", headers=headers, json=["model"])
    assert _error(answer, 400)["param"] == "model"


def test_a_body_over_the_limit_is_a_413(strict: LiveGateway) -> None:
    token = strict.fleet.tokens["strict-body"]
    headers = {"authorization": f"Bearer {token}"}
    # Known up front from content-length.
    big = strict.http.post(
        "/v1/completions", headers=headers, json={"model": "solo-model", "prompt": "x" * 4096}
    )
    assert _error(big, 413)["code"] == "request_too_large"

    # Found out while reading a chunked body (no content-length).
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"model": "solo-model", "prompt": "'
        for _ in range(8):
            yield b"x" * 512
        yield b'"}'

    streamed = strict.http.post("/v1/completions", headers=headers, content=chunks())
    assert _error(streamed, 413)["code"] == "request_too_large"
    assert strict.post("solo-model", "strict-body").status_code == 200


def test_a_token_over_its_rate_gets_429_with_retry_after(strict: LiveGateway) -> None:
    answers = [strict.post("solo-model", "strict-burst") for _ in range(4)]
    assert [a.status_code for a in answers[:3]] == [200, 200, 200]
    error = _error(answers[3], 429)
    assert error["type"] == "rate_limit_error"
    assert int(answers[3].headers["retry-after"]) >= 1
    # Another token has a bucket of its own.
    assert strict.post("solo-model", "strict-other").status_code == 200


def test_past_max_inflight_is_a_503_and_a_hung_engine_a_504(strict: LiveGateway) -> None:
    results: list[httpx.Response] = []

    def hang() -> None:
        results.append(strict.post("solo-model", "strict-inflight", canned="hang"))

    threads = [threading.Thread(target=hang) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while strict.gateway.app.inflight < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    over = strict.post("solo-model", "strict-inflight")
    assert _error(over, 503)["code"] == "overloaded"
    for t in threads:
        t.join(10)
    # upstream_timeout_s is 1 s on this gateway.
    assert sorted(r.status_code for r in results) == [504, 504]
    assert results[0].json()["error"]["code"] == "timeout"
    window = strict.gateway.windows.peek(("solo", VERSION_IDS["solo-model:v1"], "stable"))
    assert window is not None and window.errors_timeout == 2


def test_no_usable_instance_is_a_503(gateway: LiveGateway) -> None:
    error = _error(gateway.post("empty-model"), 503)
    assert error["code"] == "no_instance"
    window = gateway.gateway.windows.peek(("empty", VERSION_IDS["empty-model:v1"], "stable"))
    assert window is not None and window.errors_connect >= 1


def test_an_engine_that_drops_the_connection_is_a_502_after_one_retry(gateway: LiveGateway) -> None:
    answer = gateway.post("twice-model", canned="drop")
    assert _error(answer, 502)["code"] == "upstream_unavailable"
    request_id = answer.headers["x-request-id"]
    tried = [e.name for e in gateway.fleet.engines.values() if e.seen(request_id)]
    assert sorted(tried) == ["h", "i"]


@pytest.mark.parametrize("value", [b"a\x7fb", b"a\x1bb", b"a\x00b"])
def test_header_values_with_control_characters_never_reach_the_engine(
    gateway: LiveGateway, value: bytes
) -> None:
    # httpx refuses to send such headers, so a raw socket does. The server's parser refuses
    # them before the app runs (the app would drop such a value rather than copy it).
    token = gateway.fleet.tokens["full"]
    body = b'{"model": "solo-model", "prompt": "hi"}'
    port = int(gateway.url.rsplit(":", 1)[1])
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + token.encode()
        + b"\r\ncontent-type: application/json\r\naccept: " + value
        + b"\r\nx-request-id: ctl-test\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + body)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400")
    assert not gateway.fleet.engines["d"].seen("ctl-test")
