"""A model split over 2 and 4 gloo ranks computes what the single-process model computes.

This process is rank 0 (`start_local_group`); one group per size serves every test of that
size. Logits are compared within 1e-4 (fp32); tokens, through the real `EngineCore` on rank 0
driving the ranks, must be identical to the single-process engine's, alone and in a batch.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.core import EngineCore
from engine.errors import CheckpointError
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.kv_cache import KVCache
from engine.loader import load_model, load_tokenizer
from engine.model import Model
from engine.parallel.driver import ParallelGemmaModel, ParallelSdarModel, load_parallel_model
from engine.parallel.launcher import LocalGroup
from engine.parallel.plan import ExpertPlacement, ParallelPlan, ParallelPlanError
from engine.params import SamplingParams
from tests.engine.decoding_fixtures import run_core
from tests.engine_parallel.conftest import SDAR_VOCAB, local_group

pytestmark = pytest.mark.usefixtures("rank_zero_thread")

TOLERANCE = 1e-4
PLACEMENTS: list[ExpertPlacement] = ["expert", "tensor"]
Loader = Callable[[Path, ExpertPlacement], Any]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def group(request: pytest.FixtureRequest, rank_zero_thread: None) -> Iterator[LocalGroup]:
    yield from local_group(request.param)


@pytest.fixture(scope="module")
def parallel(group: LocalGroup) -> Iterator[Loader]:
    """Loads a checkpoint over the group once per (path, placement)."""
    loaded: dict[tuple[Path, str], Any] = {}

    def load(path: Path, experts: ExpertPlacement) -> Any:
        key = (path, experts)
        if key not in loaded:
            loaded[key] = load_parallel_model(
                group.group, path, ParallelPlan(group.group.size, experts)
            )
        return loaded[key]

    yield load
    for model in loaded.values():
        model.close()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a - b).abs().max())


@pytest.mark.parametrize("experts", PLACEMENTS)
def test_sdar_logits_equal_the_single_process_models(
    parallel: Loader, sdar_dir: Path, experts: ExpertPlacement
) -> None:
    whole = load_model(sdar_dir)
    split = parallel(sdar_dir, experts)
    assert isinstance(whole, Model) and isinstance(split, ParallelSdarModel)
    ids = torch.randint(0, SDAR_VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    # Block-causal parity form over the whole vocabulary, padded rows of the last rank cut off.
    assert max_diff(split(ids, block_size=4), whole(ids, block_size=4)) < TOLERANCE
    # A cached prefill of two blocks, then a denoising step over the next block that reads
    # the cache and asks for some rows only; every rank writes its own part of its cache.
    models: list[Any] = [whole, split]
    caches = [KVCache(m.config, 4, 32) for m in models]
    slots, lens = torch.tensor([2, 0, 3]), torch.zeros(3, dtype=torch.long)
    positions = torch.arange(8).expand(3, 8)
    for model, cache in zip(models, caches, strict=True):
        model(
            ids[:, :8],
            positions,
            block_size=4,
            cache=cache,
            slots=slots,
            cache_lens=lens,
            write_cache=True,
        )
    rows = torch.tensor([0, 2, 5, 8])
    step = [
        model(
            ids[:, 8:],
            torch.arange(8, 11).expand(3, 3),
            block_size=4,
            cache=cache,
            slots=slots,
            cache_lens=torch.full((3,), 8),
            logits_rows=rows,
        )
        for model, cache in zip(models, caches, strict=True)
    ]
    assert step[1].shape == (4, SDAR_VOCAB)
    assert max_diff(step[1], step[0]) < TOLERANCE
    # Rank 0's cache holds its K/V heads only.
    assert caches[1].keys[0].shape[1] == max(1, 2 // split.parallel_size)


@pytest.mark.parametrize("experts", PLACEMENTS)
def test_diffusion_gemma_logits_equal_the_single_process_models(
    parallel: Loader, dg_dir: Path, experts: ExpertPlacement
) -> None:
    whole = load_model(dg_dir)
    split = parallel(dg_dir, experts)
    assert isinstance(whole, DiffusionGemmaModel) and isinstance(split, ParallelGemmaModel)
    vocab = whole.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (2, 40), generator=gen)  # past the sliding window (32)
    models: list[Any] = [whole, split]
    stores = [m.new_kv(3, 96) for m in models]
    slots, lengths = torch.tensor([2, 0]), torch.tensor([40, 23])  # row 1: padding after 23
    for model, kv in zip(models, stores, strict=True):
        model.encode_into(kv, prompt, slots, torch.zeros(2, dtype=torch.long), lengths)
    canvas = torch.randint(0, vocab, (2, 16), generator=gen)
    first = [
        m.denoise_batch(kv, canvas, slots, lengths) for m, kv in zip(models, stores, strict=True)
    ]
    assert max_diff(first[1], first[0]) < TOLERANCE
    # Self-conditioned on the previous logits (split by vocabulary columns over the ranks), one
    # row without them.
    mask = torch.tensor([True, False])
    second = [
        m.denoise_batch(kv, canvas, slots, lengths, first[0], mask)
        for m, kv in zip(models, stores, strict=True)
    ]
    assert max_diff(second[1], second[0]) < TOLERANCE
    assert stores[1].keys[0].shape[1] == max(1, 2 // split.parallel_size)


PROMPTS = ["The quick brown fox", "def add(a, b):", "one two three four five six", "Block"]


def sdar_requests(tokenizer: Any) -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        f"r{i}": (
            tokenizer.encode(text),
            SamplingParams(max_tokens=12 + 3 * i, steps=2, temperature=0.8, seed=10 + i),
        )
        for i, text in enumerate(PROMPTS)
    }


@pytest.mark.parametrize("experts", PLACEMENTS)
def test_sdar_tokens_equal_the_single_process_engines_alone_and_batched(
    parallel: Loader, sdar_peaked_dir: Path, experts: ExpertPlacement
) -> None:
    tokenizer = load_tokenizer(sdar_peaked_dir)
    requests = sdar_requests(tokenizer)
    whole = load_model(sdar_peaked_dir)
    split = parallel(sdar_peaked_dir, experts)
    expected = run_core(EngineCore(whole, tokenizer, max_batch_size=4, max_seq_len=64), requests)
    batched = run_core(EngineCore(split, tokenizer, max_batch_size=4, max_seq_len=64), requests)
    for rid in requests:
        assert batched[rid].token_ids == expected[rid].token_ids, rid
    # The same request alone takes other batches, the same tokens.
    alone_core = EngineCore(split, tokenizer, max_batch_size=1, max_seq_len=64)
    alone = run_core(alone_core, {"r2": requests["r2"]})["r2"]
    assert alone.token_ids == expected["r2"].token_ids
    assert len(alone.token_ids) == requests["r2"][1].max_tokens


@pytest.mark.parametrize("experts", PLACEMENTS)
def test_diffusion_gemma_tokens_equal_the_single_process_engines_alone_and_batched(
    parallel: Loader, dg_tempered_dir: Path, experts: ExpertPlacement
) -> None:
    tokenizer = load_tokenizer(dg_tempered_dir)
    prompts = [[2, 5, 9, 11, 40, 41, 42], [2, 100, 101], [2, *range(60, 100)]]
    requests = {
        f"r{i}": (prompt, SamplingParams(max_tokens=20 + 8 * i, seed=i))
        for i, prompt in enumerate(prompts)
    }
    whole = load_model(dg_tempered_dir)
    split = parallel(dg_tempered_dir, experts)
    expected = run_core(EngineCore(whole, tokenizer, max_batch_size=3, max_seq_len=128), requests)
    batched = run_core(EngineCore(split, tokenizer, max_batch_size=3, max_seq_len=128), requests)
    for rid in requests:
        assert expected[rid].token_ids, rid
        assert batched[rid].token_ids == expected[rid].token_ids, rid
    # The same request alone takes other batches, the same tokens.
    alone_core = EngineCore(split, tokenizer, max_batch_size=1, max_seq_len=128)
    alone = run_core(alone_core, {"r1": requests["r1"]})["r1"]
    assert alone.token_ids == expected["r1"].token_ids


def test_a_shard_that_fails_to_load_is_reported_and_the_group_serves_on(
    group: LocalGroup, parallel: Loader, sdar_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(sdar_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated: every rank refuses it
    with pytest.raises(CheckpointError, match="truncated"):
        load_parallel_model(group.group, broken, ParallelPlan(group.group.size))
    with pytest.raises(ParallelPlanError, match=r"parallel\.size 3 does not match"):
        load_parallel_model(group.group, sdar_dir, ParallelPlan(3))
    # Every rank is still in step: a model loads and runs.
    model = parallel(sdar_dir, "tensor")
    assert model(torch.tensor([[5, 6, 7]])).shape == (1, 3, SDAR_VOCAB)
