"""The offline Python API: LLM.generate / LLM.chat and parameter validation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, ContextLengthExceeded, EngineError, InvalidParams, SamplingParams
from engine.core import EngineCore
from tests.engine.conftest import MASK_ID


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(tiny_checkpoint, max_batch_size=8, max_seq_len=128)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add synchronisation
    yield
    torch.set_num_threads(before)


def test_generate_accepts_text_token_ids_and_lists_in_order(llm: LLM) -> None:
    ids = llm.tokenizer.encode("Hello world")
    params = SamplingParams(max_tokens=6)
    (from_text,) = llm.generate("Hello world", params)
    (from_ids,) = llm.generate(ids, params)
    prompts: list[str | list[int]] = ["The quick brown fox", ids, "one two"]
    many = llm.generate(prompts, params)
    assert from_text.prompt_token_ids == ids
    assert from_text.token_ids == from_ids.token_ids == many[1].token_ids
    assert [o.prompt_token_ids for o in many] == [
        llm.tokenizer.encode("The quick brown fox"),
        ids,
        llm.tokenizer.encode("one two"),
    ]
    for out in many:
        assert out.finish_reason in ("length", "stop")
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.stats is not None
        assert out.stats.completion_tokens == len(out.token_ids)
        assert out.stats.forwards >= 1 and out.stats.e2e_s >= out.stats.time_to_first_block_s


def test_per_prompt_params(llm: LLM) -> None:
    outs = llm.generate(
        ["a b", "c d"], [SamplingParams(max_tokens=3), SamplingParams(max_tokens=9)]
    )
    for out, limit in zip(outs, (3, 9), strict=True):
        # A random model may emit EOS early ("stop"); otherwise exactly max_tokens.
        if out.finish_reason == "length":
            assert len(out.token_ids) == limit
        else:
            assert out.finish_reason == "stop" and len(out.token_ids) < limit
    with pytest.raises(InvalidParams) as err:
        llm.generate(["a", "b"], [SamplingParams()])
    assert err.value.field == "params"


def test_seeded_sampling_reproduces_batched_or_not_and_seeds_differ(llm: LLM) -> None:
    def sample(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed)

    (alone,) = llm.generate("The quick brown fox", sample(11))
    (again,) = llm.generate("The quick brown fox", sample(11))
    batched = llm.generate(
        ["Hello", "The quick brown fox", "def add(a, b):"],
        [sample(1), sample(11), SamplingParams(max_tokens=5)],
    )
    (other,) = llm.generate("The quick brown fox", sample(12))
    assert alone.token_ids == again.token_ids == batched[1].token_ids
    assert alone.token_ids != other.token_ids


def test_chat_uses_the_template_and_the_thinking_switch(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    (thinking,) = llm.chat(messages, SamplingParams(max_tokens=4, thinking=True))
    (direct,) = llm.chat(messages, SamplingParams(max_tokens=4, thinking=False))
    rendered = llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert "<think>" in rendered
    assert direct.prompt_token_ids == llm.tokenizer.encode_chat(messages, enable_thinking=False)
    assert thinking.prompt_token_ids == llm.tokenizer.encode_chat(messages, enable_thinking=True)
    assert thinking.prompt_token_ids != direct.prompt_token_ids
    two = llm.chat([messages, messages], SamplingParams(max_tokens=4, thinking=False))
    assert [o.token_ids for o in two] == [direct.token_ids] * 2


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"threshold": 0.0}, "threshold", "(0, 1]"),
        ({"threshold": 1.5}, "threshold", "(0, 1]"),
        ({"steps": 5}, "steps", "[1, block_size=4]"),
        ({"steps": 0}, "steps", "[1, block_size=4]"),
        ({"block_size": 8, "steps": 9}, "steps", "[1, block_size=8]"),
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_k": -1}, "top_k", ">= 0"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_steps": 0}, "min_steps", "[1, block_size=4]"),
        ({"min_steps": 3, "max_steps": 2}, "max_steps", ">= min_steps=3"),
        ({"block_size": 0}, "block_size", "[1, 128]"),
        ({"seed": -1}, "seed", "[0, "),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"thinking": "yes"}, "thinking", "true or false"),
    ],
)
def test_invalid_params_name_the_field_and_range(
    llm: LLM, kwargs: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(ValueError) as err:
        llm.generate("Hello", SamplingParams(**kwargs))
    assert isinstance(err.value, InvalidParams)
    assert err.value.field == field
    assert field in str(err.value) and fragment in str(err.value)
    assert not llm.core.has_unfinished()


def test_context_length_error_gives_both_numbers(llm: LLM) -> None:
    prompt = list(range(10, 110))  # 100 tokens
    (fits,) = llm.generate(prompt, SamplingParams(max_tokens=28))  # ceil(128/4)*4 = 128
    assert fits.finish_reason in ("length", "stop")
    with pytest.raises(ContextLengthExceeded) as err:
        llm.generate(prompt, SamplingParams(max_tokens=29))  # ceil(129/4)*4 = 132 > 128
    assert (err.value.limit, err.value.requested) == (128, 132)


def test_prompt_errors(llm: LLM) -> None:
    with pytest.raises(InvalidParams) as err:
        llm.generate([[]], SamplingParams(max_tokens=4))
    assert err.value.field == "prompt"
    with pytest.raises(InvalidParams) as err:
        llm.generate([5, 10_000], SamplingParams(max_tokens=4))
    assert err.value.field == "prompt" and "10000" in str(err.value)


def test_a_failed_batch_leaves_nothing_running(llm: LLM) -> None:
    with pytest.raises(InvalidParams):
        llm.generate(["ok", "also ok"], [SamplingParams(max_tokens=4), SamplingParams(top_k=-2)])
    assert not llm.core.has_unfinished()
    (out,) = llm.generate("ok", SamplingParams(max_tokens=4))
    assert len(out.token_ids) <= 4


def test_checkpoint_without_mask_token_cannot_diffuse(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llm.model.config, "mask_token_id", None)
    monkeypatch.setattr(llm.tokenizer, "mask_token_id", None)
    with pytest.raises(EngineError, match="mask token"):
        EngineCore(llm.model, llm.tokenizer, max_batch_size=1, max_seq_len=16)


def test_mask_token_comes_from_the_tokenizer(llm: LLM) -> None:
    assert llm.core.runner.placeholder_token_id == MASK_ID
