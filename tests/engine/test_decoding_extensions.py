"""The vLLM-style request extensions, as EngineCore decodes them on a real tiny checkpoint.

`ignore_eos`, `min_tokens`, `stop_token_ids`, `min_p` and `skip_special_tokens` are what
benchmark clients (GuideLLM, vLLM's `bench serve`, genai-perf) send; each is held to its exact
meaning here, against an unconstrained run of the same prompt.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.params import SamplingParams
from tests.engine.conftest import IM_START_ID
from tests.engine.decoding_fixtures import Parts, one_thread, peaked, run_core

__all__ = ["one_thread", "peaked"]  # fixtures, imported for pytest
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "Hello world! How are you"
# This prompt's greedy output holds <|im_start|> (a special token) among ordinary text.
SPECIAL_PROMPT = "A mixture of experts"
# And this one's ends in a run of "i": a stop string found again and again.
STOP_PROMPT = "The quick brown fox"


def free_run(parts: Parts, params: SamplingParams, prompt: str = PROMPT) -> tuple[list[int], str]:
    result = run_core(parts.core(), {"r": (parts.tokenizer.encode(prompt), params)})["r"]
    return result.token_ids, result.text


def test_stop_token_ids_end_the_request_like_eos(peaked: Parts) -> None:
    free, _ = free_run(peaked, SamplingParams(max_tokens=24))
    target = free[9]
    first = free.index(target)
    got = run_core(
        peaked.core(),
        {
            "r": (
                peaked.tokenizer.encode(PROMPT),
                SamplingParams(max_tokens=24, stop_token_ids=[target]),
            )
        },
    )["r"]
    assert got.finish_reason == "stop"
    assert got.token_ids == free[:first]
    assert got.stats is not None and got.stats.completion_tokens == first


def test_ignore_eos_generates_exactly_max_tokens_through_eos(peaked: Parts) -> None:
    free, free_text = free_run(peaked, SamplingParams(max_tokens=24))
    core = peaked.core()
    core.eos_token_ids = frozenset({free[5]})  # a token the run produces early is now EOS
    prompt = peaked.tokenizer.encode(PROMPT)
    stopped = run_core(core, {"r": (prompt, SamplingParams(max_tokens=24))})["r"]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < 24
    got = run_core(core, {"r": (prompt, SamplingParams(max_tokens=24, ignore_eos=True))})["r"]
    assert got.finish_reason == "length"
    assert got.token_ids == free  # EOS changes nothing of the decoding, only where it ends
    assert got.text == free_text
    assert got.stats is not None and got.stats.completion_tokens == 24


def test_ignore_eos_keeps_the_requests_own_stop_tokens(peaked: Parts) -> None:
    free, _ = free_run(peaked, SamplingParams(max_tokens=24))
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[free[7]])
    got = run_core(peaked.core(), {"r": (peaked.tokenizer.encode(PROMPT), params)})["r"]
    assert got.finish_reason == "stop"
    assert got.token_ids == free[: free.index(free[7])]


def test_min_tokens_forbids_eos_before_it(peaked: Parts) -> None:
    free, _ = free_run(peaked, SamplingParams(max_tokens=24))
    target = free[3]
    first = free.index(target)
    core = peaked.core()
    core.eos_token_ids = frozenset({target})
    prompt = peaked.tokenizer.encode(PROMPT)
    for min_tokens in (first + 1, first + 5, 24):
        params = SamplingParams(max_tokens=24, min_tokens=min_tokens)
        got = run_core(core, {"r": (prompt, params)})["r"]
        assert len(got.token_ids) >= min_tokens, min_tokens
        assert target not in got.token_ids[:min_tokens], min_tokens


def test_min_tokens_counts_no_stop_string_ending_before_it(peaked: Parts) -> None:
    # ignore_eos: no stop token is forbidden, so the tokens are the free run's exactly.
    params = SamplingParams(max_tokens=24, ignore_eos=True, steps=2)
    free, text = free_run(peaked, params, STOP_PROMPT)
    stop = "ii"
    decode = peaked.tokenizer.decode
    # Each occurrence of the stop string: (where it starts, the tokens whose text reaches it).
    starts = [i for i in range(len(text)) if text.startswith(stop, i)]
    reaching = [
        (pos, next(n for n in range(1, 25) if len(decode(free[:n])) >= pos + len(stop)))
        for pos in starts
    ]
    assert len(reaching) >= 2  # the test needs a later occurrence to fall back on
    for min_tokens in sorted({0, reaching[0][1], reaching[0][1] + 1, 24}):
        got = run_core(
            peaked.core(),
            {"r": (peaked.tokenizer.encode(STOP_PROMPT),
                   dataclasses.replace(params, stop=[stop], min_tokens=min_tokens))},
        )["r"]  # fmt: skip
        counted = [(pos, n) for pos, n in reaching if n >= min_tokens]
        if counted:
            pos, n = counted[0]
            assert got.finish_reason == "stop", min_tokens
            assert got.token_ids == free[:n], min_tokens
            assert got.text == text[:pos], min_tokens
        else:
            assert got.finish_reason == "length", min_tokens
            assert got.token_ids == free, min_tokens


def test_min_p_of_one_draws_only_the_most_likely_token(peaked: Parts) -> None:
    greedy, _ = free_run(peaked, SamplingParams(max_tokens=24))
    for seed in range(3):
        params = SamplingParams(max_tokens=24, temperature=1.5, min_p=1.0, seed=seed)
        assert free_run(peaked, params)[0] == greedy
    hot = SamplingParams(max_tokens=24, temperature=1.5, seed=0)
    assert free_run(peaked, hot)[0] != greedy  # the draw is otherwise free


def test_skip_special_tokens_false_keeps_them_in_the_text(peaked: Parts) -> None:
    params = SamplingParams(max_tokens=24)
    ids, skipped = free_run(peaked, params, SPECIAL_PROMPT)
    assert IM_START_ID in ids
    _, kept = free_run(
        peaked, dataclasses.replace(params, skip_special_tokens=False), SPECIAL_PROMPT
    )
    assert "<|im_start|>" in kept and "<|im_start|>" not in skipped
    assert kept == peaked.tokenizer.decode(ids, skip_special_tokens=False)
    assert kept.replace("<|im_start|>", "") == skipped
