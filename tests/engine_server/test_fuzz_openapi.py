"""Schema-driven fuzzing of /v1/completions and /v1/chat/completions against a real server.

Bodies are drawn from the request models' own JSON schemas (so most get past parsing and reach
tokenizing, the template, validation and decoding), then some are bent: a field swapped for
arbitrary JSON, an unknown field added. Whatever comes in, the answer is a 200 or an error in the
OpenAI shape below 500; 429 and 503 (queue full, draining) are answers, not crashes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.openai import ChatCompletionRequest, CompletionRequest
from tests.engine_server.conftest import MODEL, ServerProcess

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of a pydantic JSON schema (the subset our request models use), kept small."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(defs[name], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        # Now and then the special-token strings a template or the tokenizer might trip on.
        markers = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|mask|>", "<|endoftext|>"])
        return st.text(max_size=min(schema.get("maxLength", 24), 24)) | markers
    if kind == "integer":
        return st.integers(-3, 40) | st.integers()
    if kind == "number":
        return st.floats(-2, 2) | st.floats()
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        items = from_schema(schema.get("items", {}), defs)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, min(schema.get("maxItems", 3), 3)))
    if kind == "object" and "properties" in schema:
        props = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    return JSON


def bodies(model: type[CompletionRequest | ChatCompletionRequest]) -> st.SearchStrategy[Any]:
    schema = model.model_json_schema()
    valid = from_schema(schema, schema.get("$defs", {}))

    @st.composite
    def bent(draw: st.DrawFn) -> Any:
        body = draw(valid)
        body["model"] = draw(st.sampled_from([MODEL, MODEL, MODEL, "gpt-4"]))
        if draw(st.booleans()):
            field = draw(st.sampled_from([*sorted(schema["properties"]), "surprise"]))
            body[field] = draw(JSON)
        for key in ("max_tokens", "max_completion_tokens"):  # keep decoding short
            if isinstance(body.get(key), int):
                body[key] = min(body[key], 8)
        body.setdefault("max_tokens", 4)
        return body

    return bent()


def answer_is_not_a_crash(response: httpx.Response) -> None:
    event(f"HTTP {response.status_code}")  # the mix shows in --hypothesis-show-statistics
    assert response.status_code < 500 or response.status_code == 503, response.text
    if response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if response.status_code == 503:
            assert error["code"] in ("draining", "not_ready"), error
    assert "internal error" not in response.text and "engine_error" not in response.text


def send(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    content = json.dumps(body, allow_nan=True).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies(CompletionRequest))
def test_completions_never_crash(server: ServerProcess, body: Any) -> None:
    answer_is_not_a_crash(send(server, "/v1/completions", body))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies(ChatCompletionRequest))
def test_chat_completions_never_crash(server: ServerProcess, body: Any) -> None:
    answer_is_not_a_crash(send(server, "/v1/chat/completions", body))
