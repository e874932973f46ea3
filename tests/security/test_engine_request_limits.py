"""Threat: one request makes the engine server do unbounded work, or hold unbounded memory.

Before, the server read any body whole, tokenized every prompt before counting them, and took
any number of stop strings and messages of any size. Now a body over `service.max_body_bytes` is
a 413 before it is read (or as soon as it passes the limit); the number of prompts and the length
of their text are checked before a token is made; stop strings, messages and content parts are
capped while parsing. Every refusal names the field and the limit, in the OpenAI error shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.api_requests import text_budget
from engine.demo_checkpoint import create_demo_checkpoint
from engine.tokenizer import load_tokenizer
from protocol.openai import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.engine_server.conftest import MODEL, ServerProcess, raw_exchange, start_server

MAX_SEQ_LEN = 512  # what start_server configures
BODY_LIMIT = 16 * 2**20  # the default service.max_body_bytes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp("limits") / "tiny", seed=0, size="tiny")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("limits-server"),
        checkpoint,
        {"max_concurrent_requests": 4, "max_queue": 4},
    )
    yield proc
    proc.stop()


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def refusal(response: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def test_a_million_prompts_are_refused_before_any_is_tokenized(server: ServerProcess) -> None:
    # ~15 MB: under the body limit, so it is the count that must stop it.
    body = {"model": MODEL, "prompt": ["hello world!"] * 1_000_000, "max_tokens": 1}
    before = server.cpu_seconds()
    error = refusal(post(server, "/v1/completions", body))
    spent = server.cpu_seconds() - before
    assert error["param"] == "prompt"
    assert "at most 4 prompts" in error["message"]
    # Tokenizing them all costs the server ~5 s of CPU; receiving and parsing, a fraction of one.
    assert spent < 2.0, f"the server spent {spent:.1f} s of CPU on a request it refuses"


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(
    server: ServerProcess, checkpoint: Path
) -> None:
    budget = text_budget(MAX_SEQ_LEN, load_tokenizer(checkpoint).max_token_chars)
    body = {"model": MODEL, "prompt": "lorem ipsum " * 300_000, "max_tokens": 1}  # 3.6 MB
    error = refusal(post(server, "/v1/completions", body))
    assert error["param"] == "prompt"
    assert error["code"] == "context_length_exceeded"
    assert f"at most {budget}" in error["message"] and "3600000 characters" in error["message"]


def test_token_id_prompts_longer_than_the_context_are_refused(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": [[5] * 3, [5] * (MAX_SEQ_LEN + 1)], "max_tokens": 1}
    error = refusal(post(server, "/v1/completions", body))
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_a_conversation_too_long_for_the_context_is_refused_before_rendering(
    server: ServerProcess,
) -> None:
    messages = [{"role": "user", "content": "lorem ipsum " * 10_000}] * 30  # 3.6 MB in all
    error = refusal(post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages}))
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("path", "fields", "param", "needle"),
    [
        ("/v1/completions", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop",
         f"at most {MAX_STOP_STRINGS} stop strings"),
        ("/v1/completions", {"stop": "x" * (MAX_STOP_CHARS + 1)}, "stop",
         f"at most {MAX_STOP_CHARS} characters"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, "messages",
         f"at most {MAX_MESSAGES}"),
        ("/v1/chat/completions",
         {"messages": [{"role": "user",
                        "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]},
         "messages", f"at most {MAX_CONTENT_PARTS}"),
        ("/v1/completions", {"model": "m" * 300}, "model", "at most 256 characters"),
        ("/v1/completions", {"user": "u" * 300}, "user", "at most 256 characters"),
    ],
)  # fmt: skip
def test_lists_and_strings_are_capped_while_parsing(
    server: ServerProcess, path: str, fields: dict[str, Any], param: str, needle: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    body["prompt" if path == "/v1/completions" else "messages"] = (
        "Hi" if path == "/v1/completions" else [{"role": "user", "content": "Hi"}]
    )
    body.update(fields)
    error = refusal(post(server, path, body))
    assert error["param"] == param
    assert needle in error["message"]


def test_a_body_announced_over_the_limit_is_413_before_a_byte_of_it_is_read(
    server: ServerProcess,
) -> None:
    # 100 MB announced, nothing sent: an engine that waits for the body never answers.
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
        f"Content-Length: {100 * 2**20}\r\n\r\n"
    )
    response = raw_exchange(server.url, head.encode(), timeout_s=10)
    assert response is not None and response.status == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert error["type"] == "invalid_request_error"
    assert str(BODY_LIMIT) in error["message"] and "max_body_bytes" in error["message"]


def test_a_chunked_body_without_a_length_is_cut_off_at_the_limit(server: ServerProcess) -> None:
    def endless_prompt() -> Iterator[bytes]:
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(BODY_LIMIT // 2**20 + 1):
            yield b"a" * 2**20
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=endless_prompt(), timeout=60)
    error = refusal(response, 413)
    assert error["code"] == "request_too_large"
    # The server is fine afterwards.
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200
