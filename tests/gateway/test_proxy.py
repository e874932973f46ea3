"""Requests through a live gateway to canned engines: the OpenAI client, headers, pools,
retries, passive health, streaming and disconnects, and what the gateway counts."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
import uuid

import httpx
import openai
import pytest

from tests.gateway.canned_engine import COMPLETION_TOKENS
from tests.gateway.conftest import DEAD_ID, ENGINES, VERSION_IDS, LiveGateway


def _wait_for(predicate: object, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


def test_the_openai_client_works_unchanged(gateway: LiveGateway) -> None:
    client = openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=gateway.fleet.tokens["full"], max_retries=0
    )
    chat = client.chat.completions.create(
        model="solo-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content == "hello from the canned engine"
    assert chat.usage is not None and chat.usage.completion_tokens == COMPLETION_TOKENS

    text = client.completions.create(model="solo-alias", prompt="hi", max_tokens=3)
    assert text.choices[0].text == "hello"

    stream = client.chat.completions.create(
        model="solo-model",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "tok0 tok1 tok2 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == COMPLETION_TOKENS

    models = client.models.list()
    assert "solo-model" in {m.id for m in models.data}

    raw = client.completions.with_raw_response.create(model="solo-model", prompt="hi")
    assert raw.headers["x-dctl-version"] == "solo-model:v1"


def test_answers_carry_version_instance_and_request_id(gateway: LiveGateway) -> None:
    engine = gateway.fleet.engines["d"]
    mine = "req-" + uuid.uuid4().hex
    answer = gateway.post("solo-model", headers={"x-request-id": mine})
    assert answer.status_code == 200
    assert answer.headers["x-dctl-version"] == "solo-model:v1"
    assert answer.headers["x-dctl-instance"] == str(ENGINES["d"][0])
    assert answer.headers["x-request-id"] == mine
    (seen,) = engine.seen(mine)
    # The engine gets its own API key, never the client's token.
    assert seen.headers["authorization"] == "Bearer dctl_ik_key-of-d"
    assert seen.path == "/v1/completions" and seen.body["prompt"] == "hi"

    for insane in (b"x" * 129, b"has space", "ünï".encode(), b"semi;colon"):
        answer = gateway.post("solo-model", headers={"x-request-id": insane})  # type: ignore[dict-item]
        new = answer.headers["x-request-id"]
        assert new.encode() != insane and len(new) == 32
        assert engine.seen(new), "the engine gets the id the client gets"
    answer = gateway.post("solo-model")
    assert engine.seen(answer.headers["x-request-id"])


def test_non_streamed_bodies_in_chunked_encoding_and_with_connection_close(
    gateway: LiveGateway,
) -> None:
    for canned in ("chunked", "close", "chunked"):
        answer = gateway.post("solo-model", canned=canned)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == COMPLETION_TOKENS


async def _shares(url: str, token: str, n: int, concurrency: int = 16) -> dict[str, int]:
    counts: dict[str, int] = {}
    queue = list(range(n))
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:

        async def worker() -> None:
            while queue:
                queue.pop()
                answer = await http.post(
                    "/v1/completions",
                    headers={"authorization": f"Bearer {token}"},
                    json={"model": "main-model", "prompt": "hi"},
                )
                assert answer.status_code == 200, answer.text
                version = answer.headers["x-dctl-version"]
                counts[version] = counts.get(version, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def test_weight_20_sends_a_fifth_to_the_canary(gateway: LiveGateway) -> None:
    counts = asyncio.run(_shares(gateway.url, gateway.fleet.tokens["full"], 1000))
    assert sum(counts.values()) == 1000
    share = counts.get("main-model:v2", 0) / 10
    assert 16 <= share <= 24, counts
    # Within the stable pool, both instances got work (least outstanding, random ties).
    assert gateway.fleet.engines["a"].requests and gateway.fleet.engines["b"].requests


def test_a_connection_the_openai_client_still_keeps_alive_is_still_open(
    gateway: LiveGateway,
) -> None:
    # The OpenAI SDK (httpx) reuses a connection idle up to its keepalive_expiry: had the gateway
    # closed it first, the client's next POST would be reset (httpx.ReadError), not retried.
    expiry = openai._constants.DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    assert expiry is not None
    port = int(gateway.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for pause in (expiry, 0):
            sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: gateway\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            time.sleep(pause)


def test_the_pool_header_pins_the_pool(gateway: LiveGateway, strict: LiveGateway) -> None:
    for _ in range(10):
        answer = gateway.post("main-model", "pinner", headers={"x-dctl-pool": "canary"})
        assert answer.headers["x-dctl-version"] == "main-model:v2"
        assert answer.headers["x-dctl-instance"] == str(ENGINES["c"][0])
        answer = gateway.post("main-model", "pinner", headers={"x-dctl-pool": "Stable"})
        assert answer.headers["x-dctl-version"] == "main-model:v1"
    bad = gateway.post("main-model", "pinner", headers={"x-dctl-pool": "blue"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "x-dctl-pool"
    # A deployment without a canary cannot be pinned to one.
    none = gateway.post("solo-model", "pinner", headers={"x-dctl-pool": "canary"})
    assert none.status_code == 503 and "no canary pool" in none.json()["error"]["message"]
    # A token without the grant may not pin (tests/security/test_gateway_pool_pinning.py).
    refused = gateway.post("main-model", "full", headers={"x-dctl-pool": "canary"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "pool_pin_not_allowed"

    # --no-pool-header: the header is ignored, even from a token with the grant, the weight
    # decides, a bad value is no error, and a token without the grant is not refused.
    versions = {
        strict.post("main-model", "strict-pinner", headers={"x-dctl-pool": "canary"}).headers[
            "x-dctl-version"
        ]
        for _ in range(2)  # the strict gateway allows bursts of 3
    }
    assert (
        strict.post("solo-model", "strict-pool", headers={"x-dctl-pool": "blue"}).status_code == 200
    )
    assert (
        strict.post("solo-model", "strict-pool", headers={"x-dctl-pool": "canary"}).status_code
        == 200
    )
    assert versions <= {"main-model:v1", "main-model:v2"}


def test_a_dead_instance_costs_no_request_and_is_ejected(gateway: LiveGateway) -> None:
    before = gateway.metrics()
    for _ in range(30):
        answer = gateway.post("dead-model")
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-dctl-instance"] == str(ENGINES["j"][0])
    after = gateway.metrics()
    labels = f"deployment=dead,instance_id={DEAD_ID},version=dead-model:v1"
    ejected = f"dctl_gateway_ejections_total{{{labels}}}"
    assert after[ejected] >= 1
    retried = "dctl_gateway_retries_total{deployment=dead,reason=connect}"
    assert after[retried] - before.get(retried, 0) >= 3
    assert gateway.gateway.balancer.is_ejected(DEAD_ID)
    # The failed attempts count against the version, apart from the clients' answers.
    window = gateway.gateway.windows.peek(("dead", VERSION_IDS["dead-model:v1"], "stable"))
    assert window is not None and window.errors_connect >= 3


def test_a_draining_instance_is_retried_elsewhere(gateway: LiveGateway) -> None:
    draining, healthy = gateway.fleet.engines["f"], gateway.fleet.engines["g"]
    for _ in range(12):
        answer = gateway.post("draining-model")
        assert answer.status_code == 200
        assert answer.headers["x-dctl-instance"] == str(ENGINES["g"][0])
    assert draining.requests, "the 503 instance was tried"
    assert len(healthy.requests) == 12
    assert (
        gateway.metrics()["dctl_gateway_retries_total{deployment=draining,reason=unavailable}"] >= 1
    )


def test_a_503_is_retried_once_then_handed_on(gateway: LiveGateway) -> None:
    answer = gateway.post("twice-model", canned="503")
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "canned 503"  # the engine's own answer
    request_id = answer.headers["x-request-id"]
    attempts = [e.name for e in gateway.fleet.engines.values() if e.seen(request_id)]
    assert sorted(attempts) == ["h", "i"]


@pytest.mark.parametrize("failure", ["crash", "reset", "drop", "503"])
def test_an_instance_failing_before_any_byte_costs_the_client_nothing(
    gateway: LiveGateway, failure: str
) -> None:
    """What an engine shut down mid-request does (a cancelled handler's plain 500, a reset or
    closed connection, a 503): the client gets the whole answer of a second attempt."""
    for stream in (False, True):
        answer = gateway.post("twice-model", canned_first=failure, stream=stream)
        assert answer.status_code == 200, answer.text
        if stream:
            assert answer.text.endswith("data: [DONE]\n\n") and ": usage" not in answer.text
        else:
            assert answer.json()["choices"][0]["text"] == "hello"
        request_id = answer.headers["x-request-id"]
        attempts = [e.name for e in gateway.fleet.engines.values() for _ in e.seen(request_id)]
        assert len(attempts) == 2, attempts


def test_the_apis_own_5xx_is_the_clients_to_see(gateway: LiveGateway) -> None:
    """A JSON 500 is the engine's answer (a canary failing on purpose): not retried."""
    answer = gateway.post("twice-model", canned="500")
    assert answer.status_code == 500 and answer.json()["error"]["message"] == "canned 500"
    request_id = answer.headers["x-request-id"]
    assert sum(len(e.seen(request_id)) for e in gateway.fleet.engines.values()) == 1


def test_5xx_answers_pass_through_and_are_counted(gateway: LiveGateway) -> None:
    for _ in range(2):
        answer = gateway.post("errors-model", canned="500")
        assert answer.status_code == 500
        assert answer.json()["error"]["message"] == "canned 500"
        assert len(gateway.fleet.engines["e"].seen(answer.headers["x-request-id"])) == 1
    metrics = gateway.metrics()
    labels = "deployment=errors,pinned=false,pool=stable,version=errors-model:v1"
    assert metrics[f"dctl_gateway_requests_total{{code=500,{labels}}}"] == 2
    window = gateway.gateway.windows.peek(("errors", VERSION_IDS["errors-model:v1"], "stable"))
    assert window is not None and window.errors_5xx == 2


def test_sse_chunks_arrive_as_the_engine_sends_them(gateway: LiveGateway) -> None:
    body = {"model": "solo-model", "prompt": "hi", "canned": "slow", "chunks": 5, "delay": 0.2}
    headers = {"authorization": f"Bearer {gateway.fleet.tokens['full']}"}
    arrivals = []
    with gateway.http.stream("POST", "/v1/completions", json=body, headers=headers) as answer:
        assert answer.headers["content-type"] == "text/event-stream"
        for line in answer.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 6  # 5 chunks and [DONE]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps[:4]) > 0.1, f"chunks were buffered: {gaps}"


def test_a_client_that_leaves_mid_stream_closes_the_engine_request(gateway: LiveGateway) -> None:
    engine = gateway.fleet.engines["d"]
    request_id = "leaving-" + uuid.uuid4().hex
    body = {"model": "solo-model", "prompt": "hi", "canned": "slow", "chunks": 200}
    headers = {
        "authorization": f"Bearer {gateway.fleet.tokens['full']}",
        "x-request-id": request_id,
    }
    with gateway.http.stream("POST", "/v1/completions", json=body, headers=headers) as answer:
        first = next(answer.iter_bytes())
        assert first.startswith(b"data: ")
    # The client closed the connection: the engine sees its request's connection go.
    _wait_for(lambda: request_id in engine.cut_short)
    code = (
        "dctl_gateway_requests_total"
        "{code=499,deployment=solo,pinned=false,pool=stable,version=solo-model:v1}"
    )
    _wait_for(lambda: gateway.metrics().get(code, 0) >= 1)


def test_metrics_show_the_series(gateway: LiveGateway) -> None:
    gateway.post("solo-model")
    gateway.post("solo-model", stream=True, stream_options={"include_usage": True})
    metrics = gateway.metrics()
    labels = "deployment=solo,pinned=false,pool=stable,version=solo-model:v1"
    assert metrics[f"dctl_gateway_requests_total{{code=200,{labels}}}"] >= 2
    assert metrics[f"dctl_gateway_request_duration_seconds_count{{{labels}}}"] >= 2
    assert metrics[f"dctl_gateway_ttft_seconds_count{{{labels}}}"] >= 2
    inf = "deployment=solo,le=+Inf,pinned=false,pool=stable,version=solo-model:v1"
    assert metrics[f"dctl_gateway_request_duration_seconds_bucket{{{inf}}}"] >= 2
    assert metrics[f"dctl_gateway_output_tokens_total{{{labels}}}"] >= 2 * COMPLETION_TOKENS
    assert metrics["dctl_gateway_inflight{}"] == 0
    window = gateway.gateway.windows.peek(("solo", VERSION_IDS["solo-model:v1"], "stable"))
    assert window is not None and window.output_tokens >= 2 * COMPLETION_TOKENS


def test_streamed_tokens_count_without_include_usage_and_the_client_stream_is_unchanged(
    gateway: LiveGateway,
) -> None:
    key = ("solo", VERSION_IDS["solo-model:v1"], "stable")
    labels = "deployment=solo,pinned=false,pool=stable,version=solo-model:v1"
    tokens = f"dctl_gateway_output_tokens_total{{{labels}}}"
    window = gateway.gateway.windows.peek(key)
    before = (window.output_tokens if window else 0, gateway.metrics().get(tokens, 0))
    headers = {"authorization": f"Bearer {gateway.fleet.tokens['full']}"}
    body = {"model": "solo-model", "prompt": "hi", "stream": True}
    with gateway.http.stream("POST", "/v1/completions", json=body, headers=headers) as answer:
        assert answer.status_code == 200
        raw = b"".join(answer.iter_bytes())
    # The engine's usage comment was the gateway's to read, not the client's to get.
    assert b": usage" not in raw
    events = raw.split(b"\n\n")
    assert [e.startswith(b"data: ") for e in events] == [True] * 4 + [False]
    assert events[-2:] == [b"data: [DONE]", b""]
    window = gateway.gateway.windows.peek(key)
    assert window is not None and window.output_tokens - before[0] == COMPLETION_TOKENS
    assert gateway.metrics()[tokens] - before[1] == COMPLETION_TOKENS


def test_health_and_unknown_paths(gateway: LiveGateway) -> None:
    assert gateway.http.get("/health/live").status_code == 200
    ready = gateway.http.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["routes"] == "test-1"
    missing = gateway.http.get("/v1/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
    wrong = gateway.http.get("/v1/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_both_completion_paths_reach_the_engine_as_sent(gateway: LiveGateway, path: str) -> None:
    answer = gateway.post("solo-model", path=path, messages=[{"role": "user", "content": "x"}])
    assert answer.status_code == 200
    (seen,) = gateway.fleet.engines["d"].seen(answer.headers["x-request-id"])
    assert seen.path == path


def test_a_client_that_leaves_before_the_answer_closes_the_engine_request(
    gateway: LiveGateway,
) -> None:
    engine = gateway.fleet.engines["d"]
    request_id = "impatient-" + uuid.uuid4().hex
    headers = {
        "authorization": f"Bearer {gateway.fleet.tokens['full']}",
        "x-request-id": request_id,
    }
    body = {"model": "solo-model", "prompt": "hi", "canned": "hang"}
    with pytest.raises(httpx.ReadTimeout):
        gateway.http.post("/v1/completions", json=body, headers=headers, timeout=0.3)
    _wait_for(lambda: request_id in engine.cut_short)
    _wait_for(lambda: gateway.gateway.app.inflight == 0)


def test_an_engine_dying_mid_stream_cuts_the_client_stream_short(gateway: LiveGateway) -> None:
    body = {"model": "errors-model", "prompt": "hi", "canned": "slow", "chunks": 10,
            "delay": 0.01, "die_after": 3}  # fmt: skip
    headers = {"authorization": f"Bearer {gateway.fleet.tokens['full']}"}
    events = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        gateway.http.stream("POST", "/v1/completions", json=body, headers=headers) as answer,
    ):
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line:
                events.append(line)
    assert len(events) == 3 and "[DONE]" not in events[-1]  # no fake end
    labels = "deployment=errors,pinned=false,pool=stable,version=errors-model:v1"
    _wait_for(
        lambda: gateway.metrics().get(f"dctl_gateway_requests_total{{code=502,{labels}}}") == 1
    )
