"""The OpenAI-compatible API through a real server, with the official `openai` client."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.llm import LLM
from engine.params import SamplingParams
from protocol.openai import USAGE_COMMENT_PREFIX, Usage
from tests.engine_server.conftest import MODEL, ServerProcess

PROMPTS = [
    "Hello, how are you",
    "The engine reads a checkpoint",
    "One two three",
    "A fleet of machines serves",
    "The river runs past",
    "Questions and answers",
    "Good software says",
    "She wrote a letter",
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(demo_checkpoint: Path) -> LLM:
    """The same checkpoint in-process: what the server must reproduce at temperature 0."""
    return LLM(demo_checkpoint, dtype="fp32", max_batch_size=4, max_seq_len=512)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_matches_in_process_generate(client: openai.OpenAI, llm: LLM) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    [expected] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=10))
    choice = result.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == expected.finish_reason
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(llm.tokenizer.encode(PROMPTS[0]))
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + len(expected.token_ids)


def test_diffusion_knobs_reach_the_engine(
    client: openai.OpenAI, llm: LLM, server: ServerProcess
) -> None:
    knobs = {"block_size": 8, "steps": 2, "top_k": 5}
    before = server.metrics()
    result = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=0, extra_body=knobs
    )
    after = server.metrics()
    [expected] = llm.generate(PROMPTS[1], SamplingParams(max_tokens=16, **knobs))
    assert result.choices[0].text == expected.text
    # steps=2: every block of this request took at most 2 denoising steps.
    blocks = "dllm_denoising_steps_per_block_count"
    at_most_2 = "dllm_denoising_steps_per_block_bucket{le=2.0}"
    assert after[blocks] - before[blocks] == len(expected.stats.steps_per_block) >= 2
    assert after[at_most_2] - before[at_most_2] == after[blocks] - before[blocks]


def test_token_id_prompt_equals_text_prompt(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[2])
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_several_prompts_give_one_choice_each(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=5)
    assert [c.index for c in result.choices] == [0, 1, 2]
    single = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5)
    assert result.choices[1].text == single.choices[0].text


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_stream_sends_one_chunk_per_block_then_done(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 12,  # three blocks of 4
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        # SSE comment lines (the usage comment for the gateway) are no events.
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line and line[0] != ":"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    # A stopped request may end early; a block never yields more than one chunk.
    assert 1 <= len(content) <= 3
    assert chunks[-1]["usage"]["completion_tokens"] <= 12
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] in {"stop", "length"}


def test_chat_stream_equals_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def stream_lines(server: ServerProcess, body: dict[str, Any]) -> list[str]:
    """The non-empty lines of a streamed completion, as sent."""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_every_stream_ends_with_its_usage_for_the_gateway_and_the_events_stay_the_same(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 8}
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=8)
    lines = stream_lines(server, {**body, "stream": True})
    # Not asked for usage: no usage chunk, but the comment before [DONE] carries it.
    *data, comment, done = lines
    assert done == "data: [DONE]" and comment.startswith(USAGE_COMMENT_PREFIX.decode())
    usage = Usage.model_validate_json(comment.removeprefix(USAGE_COMMENT_PREFIX.decode()))
    assert whole.usage is not None
    assert usage == Usage.model_validate(whole.usage.model_dump())
    events = [json.loads(line.removeprefix("data: ")) for line in data]
    assert all("usage" not in e for e in events)
    text = "".join(e["choices"][0]["text"] for e in events)
    assert text == whole.choices[0].text
    # An SSE client never sees the comment: the same chunks as without it.
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=8, stream=True)
    )
    assert [c.choices[0].text for c in chunks] == [e["choices"][0]["text"] for e in events]
    # Asked: the usage chunk the client reads says the same as the comment.
    asked = stream_lines(
        server, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert asked[-2] == comment
    said = json.loads(comment.removeprefix(USAGE_COMMENT_PREFIX.decode()))
    assert json.loads(asked[-3].removeprefix("data: "))["usage"] == said
    # Both carry how the request was decoded (dctl's extension), as the whole answer does.
    assert whole.usage.model_dump()["dctl"] == said["dctl"]
    assert said["dctl"]["steps_per_block"] >= 1 and said["dctl"]["tokens_per_forward"] > 0


def test_chat_uses_the_template_and_the_thinking_switch(client: openai.OpenAI, llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is two plus two?"}]
    usage = {}
    for thinking in (True, False):
        result = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"thinking": thinking},
        )
        assert result.usage is not None
        usage[thinking] = result.usage.prompt_tokens
        expected = llm.tokenizer.encode_chat(messages, enable_thinking=thinking)
        assert usage[thinking] == len(expected)
    # enable_thinking=false opens the answer with an empty think section.
    assert usage[False] > usage[True]


def test_concurrent_requests_equal_single_runs_at_temperature_0(client: openai.OpenAI) -> None:
    def ask(prompt: str) -> str:
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
        return result.choices[0].text

    single = [ask(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert together == single
    assert len(set(single)) > 1  # different prompts, different answers: the check has teeth


def test_seeded_sampling_is_reproducible_over_http(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        result = client.completions.create(
            model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=1.0, seed=seed
        )
        return result.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1
