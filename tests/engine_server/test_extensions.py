"""The fields benchmark clients send beyond OpenAI's own (vLLM's and SGLang's extensions), over
HTTP: each honoured, or a 400 that names it and says why; `GET /health`; and the engine config's
`service.unknown_fields`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.api_requests import parse_body
from protocol.openai import ChatCompletionRequest, OpenAIErrorReply
from tests.engine_server.conftest import MODEL, ServerProcess, start_server

# What GuideLLM 0.8.1 sends for synthetic data with a fixed output length.
BENCHMARK_FIELDS = {
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    "stop": None,
    "ignore_eos": True,
}
# Every extension at once, each at a value that changes nothing for this checkpoint.
ALL_EXTENSIONS = {
    "ignore_eos": True,
    "min_tokens": 2,
    "top_k": 50,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "stop_token_ids": [5],
}
CHAT = [{"role": "user", "content": "Hello there"}]


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def stream_events(server: ServerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def error_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return dict(response.json()["error"])


def test_health_answers_like_vllm_once_ready(server: ServerProcess) -> None:
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ready"
    # The finer probes stay.
    assert httpx.get(f"{server.url}/health/live", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/health/ready", timeout=10).status_code == 200


@pytest.mark.parametrize("max_tokens", [1, 7, 24])
def test_ignore_eos_reports_exactly_max_tokens(server: ServerProcess, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    answer = post(server, "/v1/completions", body).json()
    assert answer["usage"]["completion_tokens"] == max_tokens
    assert answer["choices"][0]["finish_reason"] == "length"
    chat = {"model": MODEL, "messages": CHAT, "max_completion_tokens": max_tokens}
    answer = post(server, "/v1/chat/completions", {**chat, "ignore_eos": True}).json()
    assert answer["usage"]["completion_tokens"] == max_tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_extension_is_accepted_at_once(server: ServerProcess, path: str) -> None:
    body = {"model": MODEL, "max_tokens": 12, **ALL_EXTENSIONS}
    body.update({"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT})
    answer = post(server, path, body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_cumulative_usage_in_every_chunk(
    server: ServerProcess, path: str
) -> None:
    body = {"model": MODEL, "max_tokens": 13, "stream": True, "steps": 4, **BENCHMARK_FIELDS}
    body.update({"prompt": "Hello"} if path == "/v1/completions" else {"messages": CHAT})
    events = stream_events(server, path, body)
    usages = [event["usage"] for event in events]  # every chunk: none without
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion)  # cumulative: it never goes back
    assert completion[-1] == 13  # ignore_eos: exactly max_tokens
    assert len({u["prompt_tokens"] for u in usages}) == 1
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # include_usage's own last chunk still comes, with no choices.
    assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "length"


def test_without_continuous_usage_only_the_last_chunk_has_usage(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 9, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = stream_events(server, "/v1/completions", body)
    assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["usage"]["completion_tokens"] == 9


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"repetition_penalty": 1.2}, "repetition_penalty", "block-diffusion"),
        (
            {"skip_special_tokens": False, "spaces_between_special_tokens": True},
            "spaces_between_special_tokens",
            "no space added",
        ),
        ({"min_tokens": 9}, "min_tokens", "max_tokens=4"),
        ({"min_tokens": -1}, "min_tokens", "[0, max_tokens=4]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids", "cannot generate"),
        ({"stop_token_ids": list(range(65))}, "stop_token_ids", "64"),
        ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
        ({"stream_options": {"continuous_usage": True}}, "stream_options", "unknown field"),
    ],
)
def test_an_extension_we_cannot_honour_is_a_400_naming_it(
    server: ServerProcess, fields: dict[str, Any], param: str, needle: str
) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}
    error = error_of(post(server, "/v1/completions", body))
    assert error["param"] == param
    assert needle in error["message"]


def test_skip_special_tokens_false_with_no_space_setting_is_accepted(
    server: ServerProcess,
) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "skip_special_tokens": False,
            "spaces_between_special_tokens": False}  # fmt: skip
    assert post(server, "/v1/completions", body).status_code == 200


def test_an_unknown_field_is_a_400_by_default(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "ignore_eos_": True}
    error = error_of(post(server, "/v1/completions", body))
    assert error["param"] == "ignore_eos_" and error["code"] == "unknown_field"


def test_unknown_fields_ignore_drops_and_counts_them(tmp_path: Path, demo_checkpoint: Path) -> None:
    server = start_server(tmp_path, demo_checkpoint, {"unknown_fields": "ignore"})
    try:
        options = {"include_usage": True, "chunk_size": 2}
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "best_of_n": 3,
                "stream_options": options, "stream": True}  # fmt: skip
        events = stream_events(server, "/v1/completions", body)
        assert events[-1]["usage"]["completion_tokens"] >= 1
        chat = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "guided_json": {}}
        assert post(server, "/v1/chat/completions", chat).status_code == 200
        assert server.metrics()["dllm_request_unknown_fields_total"] == 3
        # A known field with a bad value is still refused.
        error = error_of(post(server, "/v1/completions", {**body, "min_p": 7}))
        assert error["param"] == "min_p"
    finally:
        server.stop()


def test_ignore_drops_unknown_fields_at_any_depth() -> None:
    part = {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "top_a": 1,
            "stream_options": {"include_usage": True, "chunked": 1}}  # fmt: skip
    raw = json.dumps(body).encode()
    with pytest.raises(OpenAIErrorReply) as refused:
        parse_body(raw, ChatCompletionRequest)
    assert refused.value.code == "unknown_field"
    request, dropped = parse_body(raw, ChatCompletionRequest, ignore_unknown=True)
    assert sorted(dropped) == [
        "messages.0.content.list[TextPart].0.cache_control",
        "stream_options.chunked",
        "top_a",
    ]
    assert request.messages[0].text() == "hi" and request.stream_options.include_usage
