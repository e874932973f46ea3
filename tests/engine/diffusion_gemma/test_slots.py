"""The slot form (what continuous batching runs) against the simple form, which the parity tests
hold to transformers: rows at different lengths in one call, ragged prompts, self-conditioning
per row, the store's sizes and bounds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.families.diffusion_gemma.kv import EncoderKV
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.loader import load_model
from tests.engine.diffusion_gemma.checkpoints import TINY_VOCAB

# Rows computed in different calls agree to float32 rounding: 1e-5 of the logits' scale (the
# tiny checkpoints' logits reach ~20; matmuls of other shapes round differently).
ROW_TOL = 1e-5


def assert_same_row(got: torch.Tensor, expected: torch.Tensor, tol: float = ROW_TOL) -> None:
    """Same argmax everywhere, logits within TOL of their largest magnitude."""
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    scale = max(1.0, expected.abs().max().item())
    assert (got - expected).abs().max().item() <= tol * scale


@pytest.fixture(scope="module")
def model(dg_checkpoint: Callable[[str], Path]) -> DiffusionGemmaModel:
    loaded = load_model(dg_checkpoint("base"), dtype=torch.float32)
    assert isinstance(loaded, DiffusionGemmaModel)
    return loaded


def ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def test_a_row_does_not_depend_on_the_rest_of_its_batch(model: DiffusionGemmaModel) -> None:
    """Three prompts of different lengths (two past the sliding window) encoded in one ragged
    call into scattered slots, then denoised together, one with self-conditioning off: each
    row's logits are its own, alone in a call or in a fresh simple-form cache."""
    lengths = [5, 13, 9]
    prompts = [ids((1, n), seed=n) for n in lengths]
    padded = torch.zeros(3, max(lengths), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        padded[row, : prompt.shape[1]] = prompt[0]
    slots, lens = torch.tensor([2, 0, 3]), torch.tensor(lengths)
    kv = model.new_kv(num_slots=4, max_seq_len=32)
    model.encode_into(kv, padded, slots, torch.zeros(3, dtype=torch.long), lengths=lens)

    canvas = ids((3, 8), seed=20)
    sc = 4 * torch.randn(3, 8, TINY_VOCAB, generator=torch.Generator().manual_seed(21))
    with_sc = torch.tensor([True, False, True])
    batch = model.denoise_batch(kv, canvas, slots, lens, sc, with_sc)
    for row in range(3):
        row_sc = sc[row : row + 1] if with_sc[row] else None
        alone = model.denoise_batch(
            kv, canvas[row : row + 1], slots[row : row + 1], lens[row : row + 1], row_sc
        )
        fresh = model.denoise(model.encode(prompts[row]), canvas[row : row + 1], row_sc)
        assert_same_row(batch[row], alone[0])
        assert_same_row(batch[row], fresh[0])


def test_committed_canvases_append_per_row(model: DiffusionGemmaModel) -> None:
    """encode_into appends after each row's own cache_len: rows at different lengths encode a
    canvas in one call and denoise as if each had been encoded alone."""
    kv = model.new_kv(num_slots=2, max_seq_len=40)
    first, second = ids((1, 3), seed=30), ids((1, 11), seed=31)
    slots = torch.tensor([1, 0])
    model.encode_into(kv, first, slots[:1], torch.tensor([0]))
    model.encode_into(kv, second, slots[1:], torch.tensor([0]))
    committed = ids((2, 8), seed=32)
    model.encode_into(kv, committed, slots, torch.tensor([3, 11]))
    canvas = ids((2, 8), seed=33)
    batch = model.denoise_batch(kv, canvas, slots, torch.tensor([11, 19]))
    for row, prompt in enumerate((first, second)):
        cache = model.encode(prompt)
        model.encode(committed[row : row + 1], cache)
        fresh = model.denoise(cache, canvas[row : row + 1])
        assert_same_row(batch[row], fresh[0])


def test_self_conditioning_changes_the_logits(model: DiffusionGemmaModel) -> None:
    cache = model.encode(ids((1, 6), seed=40))
    canvas = ids((1, 8), seed=41)
    sc = 4 * torch.randn(1, 8, TINY_VOCAB, generator=torch.Generator().manual_seed(42))
    assert (model.denoise(cache, canvas, sc) - model.denoise(cache, canvas)).abs().max() > 0.1


def test_the_simple_cache_grows_and_keeps_what_it_held(model: DiffusionGemmaModel) -> None:
    """Past its first 256 positions the simple form's store is reallocated; encoding in two
    chunks across that boundary gives the logits of one chunk."""
    prompt, canvas = ids((1, 300), seed=50), ids((1, 8), seed=51)
    whole = model.encode(prompt)
    parts = model.encode(prompt[:, :200])
    assert parts.kv.max_seq_len == 256
    model.encode(prompt[:, 200:], parts)
    assert parts.kv.max_seq_len >= 300 and parts.length == 300
    assert_same_row(model.denoise(parts, canvas), model.denoise(whole, canvas))


def test_the_store_keeps_sliding_layers_in_a_ring(model: DiffusionGemmaModel) -> None:
    """Sliding layers (window 4: 3 positions kept) cost a fixed ring per slot; full-attention
    layers (1 K/V head of 16) cost 2 * 16 * 4 bytes per position each, two of them."""
    kv = EncoderKV(model.config, num_slots=3, max_seq_len=100)
    assert kv.capacities == (3, 100, 3, 100)
    assert kv.bytes_per_token == 2 * (2 * 16 * 4)
    ring = 2 * (2 * 2 * 8 * 3 * 4)  # two sliding layers: k and v, 2 heads of 8, 3 positions
    assert kv.bytes_per_slot == ring + 100 * kv.bytes_per_token
    held = sum(t.numel() * t.element_size() for t in (*kv.keys, *kv.values))
    assert kv.bytes_total == held == 3 * kv.bytes_per_slot


def test_bad_calls_are_refused(model: DiffusionGemmaModel) -> None:
    kv = model.new_kv(num_slots=2, max_seq_len=16)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="slots must be in"):
        model.encode_into(kv, ids((1, 4), seed=1), torch.tensor([2]), one * 0)
    with pytest.raises(ValueError, match="exceed the 16 positions"):
        model.encode_into(kv, ids((1, 4), seed=1), one, torch.tensor([13]))
    with pytest.raises(ValueError, match="self_conditioning_logits must be"):
        model.denoise_batch(kv, ids((1, 8), seed=1), one, one, torch.zeros(1, 8, 5))
    with pytest.raises(ValueError, match="the cache holds 1 rows"):
        model.denoise(model.encode(ids((1, 4), seed=1)), ids((2, 8), seed=2))
