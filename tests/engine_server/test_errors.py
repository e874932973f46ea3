"""Everything a client can get wrong is answered in the OpenAI error shape, never with a 500."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine_server.conftest import MODEL, ServerProcess


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return dict(body["error"])


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (completion(threshold=1.5), "threshold", "(0, 1]"),
        (completion(temperature=-1), "temperature", ">= 0"),
        (completion(top_p=0), "top_p", "(0, 1]"),
        (completion(max_tokens=0), "max_tokens", ">= 1"),
        (completion(steps=9), "steps", "block_size=4"),
        (completion(min_steps=0), "min_steps", "[1, block_size=4]"),
        (completion(max_tokens="many"), "max_tokens", "integer"),
        (completion(stop=[""]), "stop", "non-empty"),
        (completion(treshold=0.5), "treshold", "unknown field"),
        (completion(n=2), "n", "n=2"),
        (completion(logprobs=3), "logprobs", "not supported"),
        (completion(prompt=""), "prompt", "at least one token"),
        (completion(prompt=[]), "prompt", "empty"),
        (completion(prompt=[1, 99999]), "prompt", "token ids"),
        (completion(prompt=["a", "b", "c", "d", "e"]), "prompt", "at most 4 prompts"),
        (completion(prompt=["a", "b"], stream=True), "prompt", "exactly one prompt"),
        ({"prompt": "Hello"}, "model", "required"),
    ],
)
def test_invalid_completion_fields_are_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, needle: str
) -> None:
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert needle in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, None),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "x": 1}]}],
            },
            "messages",
        ),
        ({"model": MODEL, "messages": "hello"}, "messages"),
    ],
)
def test_invalid_chat_bodies_are_400(
    server: ServerProcess, body: dict[str, Any], param: str | None
) -> None:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = error_of(response)
    if param is not None:
        assert error["param"] == param


def test_an_image_part_is_a_400_that_says_images_are_not_served(server: ServerProcess) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "What is in this picture?"}, image]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == "messages"
    assert "content part 1 is an image ('image_url')" in error["message"]
    assert "text only" in error["message"]


def test_the_openai_client_sees_a_bad_request_error(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"threshold": 0})
    assert info.value.body["param"] == "threshold"  # type: ignore[index]


def test_context_length_exceeded_gives_the_limit_and_the_size(server: ServerProcess) -> None:
    # max_seq_len 512, block 4: a 5-token prompt + 600 tokens needs ceil(605 / 4) * 4 = 608.
    prompt = [10, 11, 12, 13, 14]
    response = post(server, "/v1/completions", completion(prompt=prompt, max_tokens=600))
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "context_length_exceeded"
    assert "512" in error["message"] and "608" in error["message"]


def test_unknown_model_is_404(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"
    assert MODEL in info.value.message


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"])
def test_malformed_json_is_400(server: ServerProcess, raw: bytes) -> None:
    response = post(server, "/v1/completions", raw)
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


def test_unknown_route_and_wrong_method_keep_the_error_shape(server: ServerProcess) -> None:
    missing = httpx.get(f"{server.url}/v1/engines", timeout=10)
    assert missing.status_code == 404
    error_of(missing)
    wrong = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert wrong.status_code == 405
    error_of(wrong)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server: ServerProcess) -> None:
    server.wait_idle()
    before = server.metrics()["dllm_requests_finished_total{finish_reason=abort}"]
    body = completion(prompt="Hello there", max_tokens=400, steps=4, stream=True)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
        assert server.metrics()["dllm_requests_running"] == 1
    # The connection is closed: the server notices and aborts long before 400 tokens are done.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["dllm_requests_running"] == 0:
            break
        time.sleep(0.1)
    m = server.metrics()
    assert m["dllm_requests_running"] == 0
    assert m["dllm_requests_finished_total{finish_reason=abort}"] == before + 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)
field_names = st.sampled_from(
    ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop",
     "seed", "stream", "block_size", "threshold", "steps", "min_steps", "max_steps", "n",
     "thinking", "stream_options", "logit_bias", "max_completion_tokens"]
)  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    fields=st.dictionaries(field_names, json_values, max_size=5),
)
def test_any_body_gets_200_or_an_openai_error_below_500(
    server: ServerProcess, path: str, fields: dict[str, Any]
) -> None:
    """Arbitrary JSON in any field: a 200, or a 4xx in the OpenAI error shape; never a 5xx."""
    body = {
        "model": MODEL,
        "prompt": "Hi",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
    }
    body.update(fields)
    for key in ("max_tokens", "max_completion_tokens"):  # keep generations short
        if isinstance(body.get(key), int):
            body[key] = min(body[key], 8)
    body.pop("prompt" if path.endswith("chat/completions") else "messages")
    try:
        response = post(server, path, json.dumps(body, allow_nan=True).encode())
    except ValueError:
        return
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        error_of(response)
