"""End-to-end decoding rules of EngineCore on a real tiny checkpoint (fp32, CPU)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.errors import ContextLengthExceeded
from engine.params import SamplingParams
from tests.engine.conftest import MASK_ID
from tests.engine.decoding_fixtures import (
    Parts,
    assert_matches_reference,
    one_thread,
    peaked,
    reference_decode,
    run_core,
)

__all__ = ["one_thread", "peaked"]  # fixtures, imported for pytest
pytestmark = pytest.mark.usefixtures("one_thread")

EOS = {0, 2}
PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you",
    "def add(a, b):",
    "one two three four five six seven eight nine",
    "A mixture of experts",
    "GPU hosts serve models; the control plane rolls",
    "Block",
    "seven eight nine ten",
]


def prompt_ids(parts: Parts, i: int) -> list[int]:
    return parts.tokenizer.encode(PROMPTS[i % len(PROMPTS)])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, steps=4),
        SamplingParams(max_tokens=24, steps=2),
        SamplingParams(max_tokens=24),  # threshold mode, 0.9
        SamplingParams(max_tokens=24, threshold=0.6, min_steps=2),
        SamplingParams(max_tokens=24, threshold=0.99, max_steps=2),
    ],
    ids=["steps4", "steps2", "threshold", "threshold-min-steps", "threshold-max-steps"],
)
def test_single_request_matches_full_recompute_reference(
    peaked: Parts, params: SamplingParams
) -> None:
    for i in range(3):
        prompt = prompt_ids(peaked, i)
        got = run_core(peaked.core(), {"r": (prompt, params)})["r"]
        ref = reference_decode(peaked.model, prompt, params, block_size=4, eos=EOS)
        assert_matches_reference(got.token_ids, ref, f"prompt {i}")


def mixed_batch(parts: Parts) -> dict[str, tuple[list[int], SamplingParams]]:
    """Eight requests: mixed prompt lengths, block sizes, modes and bounds."""
    variants = [
        SamplingParams(max_tokens=20, steps=4),
        SamplingParams(max_tokens=13),
        SamplingParams(max_tokens=17, block_size=8, steps=4),
        SamplingParams(max_tokens=9, threshold=0.5),
        SamplingParams(max_tokens=22, block_size=2, steps=1),
        SamplingParams(max_tokens=16, threshold=0.95, min_steps=3),
        SamplingParams(max_tokens=11, block_size=8, threshold=0.8, max_steps=3),
        SamplingParams(max_tokens=15, steps=3),
    ]
    return {f"r{i}": (prompt_ids(parts, i), p) for i, p in enumerate(variants)}


def test_mixed_batch_matches_reference_per_request(peaked: Parts) -> None:
    batch = mixed_batch(peaked)
    results = run_core(peaked.core(max_batch_size=8), batch)
    for rid, (prompt, params) in batch.items():
        block = params.block_size or 4
        ref = reference_decode(peaked.model, prompt, params, block_size=block, eos=EOS)
        assert_matches_reference(results[rid].token_ids, ref, rid)


def test_batch_invariance_alone_and_inside_a_batch_of_eight(peaked: Parts) -> None:
    batch = mixed_batch(peaked)
    batch["r3"] = (batch["r3"][0], SamplingParams(max_tokens=19, temperature=0.9, seed=5))
    together = run_core(peaked.core(max_batch_size=8), batch)
    for rid, request in batch.items():
        alone = run_core(peaked.core(max_batch_size=1), {rid: request})[rid]
        assert alone.token_ids == together[rid].token_ids, rid
        assert alone.text == together[rid].text, rid


def test_threshold_mode_unmasks_several_tokens_in_some_steps_and_one_in_others(
    peaked: Parts,
) -> None:
    core = peaked.core(max_batch_size=1)
    core.add_request("r", prompt_ids(peaked, 0), SamplingParams(max_tokens=40, threshold=0.9))
    per_step = []
    while core.has_unfinished():
        core.step()
        if core.last_step.tokens_unmasked:
            per_step.append(core.last_step.tokens_unmasked)
    assert any(n >= 2 for n in per_step), per_step
    assert any(n == 1 for n in per_step), per_step


def test_steps_mode_takes_exactly_steps_per_full_block(peaked: Parts) -> None:
    prompt = prompt_ids(peaked, 0)[:8]  # two full prompt blocks: every decoded block is full
    params = SamplingParams(max_tokens=16, block_size=8, steps=4)
    result = run_core(peaked.core(), {"r": (prompt, params)})["r"]
    assert result.stats is not None
    assert result.stats.steps_per_block == [4, 4]
    # 1 prefill + 4 steps + 4 steps: the first block's commit rides in the second block's
    # first step, and the last block needs no commit.
    assert result.stats.forwards == 9
    assert result.stats.tokens_per_forward == pytest.approx(16 / 9)


def test_max_tokens_ending_mid_block_cuts_exactly(peaked: Parts) -> None:
    prompt = prompt_ids(peaked, 3)[:9]  # 9 tokens: first block has 3 generated positions
    long = run_core(peaked.core(), {"r": (prompt, SamplingParams(max_tokens=30))})["r"]
    for max_tokens in (1, 3, 6, 7):
        short = run_core(peaked.core(), {"r": (prompt, SamplingParams(max_tokens=max_tokens))})
        got = short["r"]
        assert got.finish_reason == "length"
        assert got.token_ids == long.token_ids[:max_tokens]
        assert got.stats is not None and got.stats.completion_tokens == max_tokens


def test_eos_ends_output_before_the_eos_token(peaked: Parts) -> None:
    prompt = prompt_ids(peaked, 1)
    free = run_core(peaked.core(), {"r": (prompt, SamplingParams(max_tokens=24))})["r"]
    target = free.token_ids[9]
    first = free.token_ids.index(target)
    core = peaked.core()
    # Declaring a token the run produces as EOS shows where the engine cuts.
    core.eos_token_ids = frozenset({target})
    got = run_core(core, {"r": (prompt, SamplingParams(max_tokens=24))})["r"]
    assert got.finish_reason == "stop"
    assert got.token_ids == free.token_ids[:first]
    assert got.text == peaked.tokenizer.decode(free.token_ids[:first])


def test_eos_ids_come_from_the_generation_config(peaked: Parts) -> None:
    assert peaked.core().eos_token_ids == frozenset(EOS)


def test_stop_string_cuts_text_before_it(peaked: Parts) -> None:
    prompt = prompt_ids(peaked, 2)
    free = run_core(peaked.core(), {"r": (prompt, SamplingParams(max_tokens=40))})["r"]
    stop = free.text[12:14]
    assert len(stop) == 2
    got = run_core(peaked.core(), {"r": (prompt, SamplingParams(max_tokens=40, stop=[stop]))})
    result = got["r"]
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.find(stop)]
    assert stop not in result.text
    kept = len(result.token_ids)
    assert result.token_ids == free.token_ids[:kept]
    assert stop in peaked.tokenizer.decode(result.token_ids)
    assert stop not in peaked.tokenizer.decode(result.token_ids[:-1])


def test_stop_strings_anywhere_are_found_across_steps_and_blocks(peaked: Parts) -> None:
    """A stop string at every position of an output (block boundaries included, tokens arriving
    a few per step) ends the request exactly where one search of the full text would."""
    prompt = prompt_ids(peaked, 0)
    params = SamplingParams(max_tokens=24, steps=2)  # 2 tokens a step, blocks of 4
    free = run_core(peaked.core(), {"r": (prompt, params)})["r"]
    for start in range(len(free.text) - 2):
        stop = free.text[start : start + 3]
        got = run_core(peaked.core(), {"r": (prompt, dataclasses.replace(params, stop=[stop]))})
        result = got["r"]
        cut = free.text.find(stop)
        assert result.finish_reason == "stop", stop
        assert result.text == free.text[:cut], stop
        assert result.token_ids == free.token_ids[: len(result.token_ids)]
        needed = cut + len(stop)
        assert len(peaked.tokenizer.decode(result.token_ids)) >= needed
        assert len(peaked.tokenizer.decode(result.token_ids[:-1])) < needed


def test_mask_token_never_in_output(peaked: Parts) -> None:
    batch = {
        f"s{i}": (prompt_ids(peaked, i), SamplingParams(max_tokens=30, temperature=1.5, seed=i))
        for i in range(4)
    }
    for result in run_core(peaked.core(), batch).values():
        assert MASK_ID not in result.token_ids
        assert all(t < peaked.tokenizer.vocab_size for t in result.token_ids)


def test_context_check_is_exact(peaked: Parts) -> None:
    prompt = prompt_ids(peaked, 3)[:10]
    params = SamplingParams(max_tokens=7)  # ceil(17 / 4) * 4 = 20 positions
    result = run_core(peaked.core(max_seq_len=20), {"r": (prompt, params)})["r"]
    assert len(result.token_ids) == 7
    with pytest.raises(ContextLengthExceeded) as err:
        peaked.core(max_seq_len=19).add_request("r", prompt, params)
    assert (err.value.limit, err.value.requested, err.value.field) == (19, 20, "max_tokens")
    assert "19" in str(err.value) and "20" in str(err.value)


def test_streamed_blocks_add_up_to_the_final_output(peaked: Parts) -> None:
    params = SamplingParams(max_tokens=21, steps=2)
    result = run_core(peaked.core(), {"r": (prompt_ids(peaked, 4), params)})["r"]
    assert result.updates >= 5  # one per committed block, plus the finish
    assert result.text == peaked.tokenizer.decode(result.token_ids)
