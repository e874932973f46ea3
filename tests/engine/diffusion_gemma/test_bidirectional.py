"""The encoder's attention rules, stated on what it stores.

transformers 5.24 cannot run `use_bidirectional_attention: "all"` (its attention gets
`is_causal` twice), so the bidirectional encoder is held to our rules (engine.families.
diffusion_gemma.config): full-attention layers see the whole encoded sequence both ways, a
sliding layer sees keys within W // 2 positions either side. The causal encoder, which the
parity tests hold to transformers, is the contrast.

A full-attention layer keeps every position's keys, so they show what reached a position:
layer 1's keys at position 0 come from layer 0 (sliding) at position 0 alone; layer 3's from
layer 2 (sliding) over positions 0..2, each of which saw everything through layer 1 (full).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.loader import load_model
from tests.engine.diffusion_gemma.checkpoints import TINY_VOCAB

PROMPT = torch.tensor([[5, 17, 29, 41, 53, 65, 77, 89]])
# A token that reaches another moves its keys by ~0.1-1; one that does not, by float rounding at
# most (other tokens route to other experts, so the experts' matmuls take other shapes).
UNMOVED, MOVED = 1e-5, 1e-2


def moved(before: torch.Tensor, after: torch.Tensor) -> float:
    return (before - after).abs().max().item()


def stored_keys(model: DiffusionGemmaModel, prompt: torch.Tensor, layer: int) -> torch.Tensor:
    """Keys LAYER stored for position 0 after encoding PROMPT."""
    cache = model.encode(prompt)
    return cache.kv.keys[layer][0, :, 0].clone()


def with_token(position: int) -> torch.Tensor:
    changed = PROMPT.clone()
    changed[0, position] = (changed[0, position] + 1) % TINY_VOCAB
    return changed


@pytest.fixture(scope="module")
def load(dg_checkpoint: Callable[[str], Path]) -> Callable[[str], DiffusionGemmaModel]:
    def get(name: str) -> DiffusionGemmaModel:
        model = load_model(dg_checkpoint(name), dtype=torch.float32)
        assert isinstance(model, DiffusionGemmaModel)
        return model

    return get


def test_the_bidirectional_window_is_half_the_configured_one(
    load: Callable[[str], DiffusionGemmaModel],
) -> None:
    model = load("bidirectional")
    assert model.config.bidirectional_encoder
    assert model.config.sliding_window == 4 and model.config.sliding_context == 2


def test_a_bidirectional_encoder_lets_an_early_token_see_a_later_one(
    load: Callable[[str], DiffusionGemmaModel],
) -> None:
    model = load("bidirectional")
    before = stored_keys(model, PROMPT, layer=3)
    assert moved(before, stored_keys(model, with_token(7), layer=3)) > MOVED


def test_a_causal_encoder_keeps_an_early_token_blind_to_later_ones(
    load: Callable[[str], DiffusionGemmaModel],
) -> None:
    model = load("base")
    before = stored_keys(model, PROMPT, layer=3)
    for position in range(1, 8):
        assert moved(before, stored_keys(model, with_token(position), layer=3)) <= UNMOVED


def test_a_bidirectional_sliding_layer_sees_half_its_window_either_side(
    load: Callable[[str], DiffusionGemmaModel],
) -> None:
    """Through sliding layer 0, position 0 sees positions 1 and 2 (|d| <= 4 // 2), not 3."""
    model = load("bidirectional")
    before = stored_keys(model, PROMPT, layer=1)
    assert moved(before, stored_keys(model, with_token(2), layer=1)) > MOVED
    for position in range(3, 8):
        assert moved(before, stored_keys(model, with_token(position), layer=1)) <= UNMOVED


def test_encoding_in_chunks_keeps_earlier_chunks_fixed(
    load: Callable[[str], DiffusionGemmaModel],
) -> None:
    """A committed chunk is encoded once: later chunks attend to it, never rewrite it."""
    model = load("bidirectional")
    cache = model.encode(PROMPT[:, :4])
    first = [k[0, :, :4].clone() for k in (cache.kv.keys[1], cache.kv.keys[3])]
    model.encode(PROMPT[:, 4:], cache)
    assert torch.equal(first[0], cache.kv.keys[1][0, :, :4])
    assert torch.equal(first[1], cache.kv.keys[3][0, :, :4])
