"""Our DiffusionGemma against transformers' own: same checkpoint, same decoder logits.

Each tiny checkpoint (`checkpoints.VARIANTS`) is written by `save_pretrained`, loaded back with
`engine.load_model` and with `DiffusionGemmaForBlockDiffusion.from_pretrained`, and the fp32
logits compared (max abs diff <= 1e-4): a prompt longer than the sliding window then a canvas,
with and without self-conditioning; and the generation order (encode the prompt, encode each
committed canvas after it, denoise the next canvas) against the reference's cache path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.loader import load_model
from tests.engine.diffusion_gemma.checkpoints import TINY_VOCAB, load_reference

TOL = 1e-4


@pytest.fixture(scope="module")
def models(
    dg_checkpoint: Callable[[str], Path],
) -> Callable[[str], tuple[DiffusionGemmaModel, Any]]:
    """(ours, transformers') for a named checkpoint, loaded once per module."""
    loaded: dict[str, tuple[DiffusionGemmaModel, Any]] = {}

    def get(name: str) -> tuple[DiffusionGemmaModel, Any]:
        if name not in loaded:
            directory = dg_checkpoint(name)
            ours = load_model(directory, dtype=torch.float32)
            assert isinstance(ours, DiffusionGemmaModel)
            loaded[name] = (ours, load_reference(directory))
        return loaded[name]

    return get


def ids(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def previous_logits(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Logits as a previous step leaves them: peaked enough that their softmax is far from flat."""
    return 4 * torch.randn(*shape, TINY_VOCAB, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("self_conditioning", [False, True], ids=["no-sc", "sc"])
@pytest.mark.parametrize("name", ["base", "canvas16", "untied"])
def test_prompt_and_canvas_logits_match_transformers(
    models: Callable[[str], tuple[DiffusionGemmaModel, Any]], name: str, self_conditioning: bool
) -> None:
    ours, ref = models(name)
    canvas_length = ours.config.canvas_length
    prompt = ids((2, 11), seed=1)  # longer than every variant's sliding window
    canvas = ids((2, canvas_length), seed=2)
    sc = previous_logits((2, canvas_length), seed=3) if self_conditioning else None
    with torch.no_grad():
        expected = ref(input_ids=prompt, decoder_input_ids=canvas, self_conditioning_logits=sc)
    got = ours.denoise(ours.encode(prompt), canvas, sc)
    assert got.dtype == torch.float32
    assert got.shape == (2, canvas_length, TINY_VOCAB)
    assert (got - expected.logits).abs().max().item() <= TOL


def test_softcapping_bounds_the_logits(
    models: Callable[[str], tuple[DiffusionGemmaModel, Any]],
) -> None:
    """canvas16's cap of 3 bites: its logits stay inside (-3, 3) and reach near the bound."""
    ours, _ = models("canvas16")
    logits = ours.denoise(ours.encode(ids((1, 5), seed=4)), ids((1, 16), seed=5))
    assert logits.abs().max().item() < 3.0
    assert logits.abs().max().item() > 2.5


@pytest.mark.parametrize("name", ["base", "canvas16"])
def test_generation_order_matches_the_reference_cache_path(
    models: Callable[[str], tuple[DiffusionGemmaModel, Any]], name: str
) -> None:
    """Prompt, then two committed canvases encoded after it (the sliding layers' ring wraps),
    then the next canvas denoised: as transformers' generate() drives its DynamicCache."""
    from transformers import DynamicCache

    ours, ref = models(name)
    c = ours.config.canvas_length
    prompt, committed = ids((1, 9), seed=6), [ids((1, c), seed=7), ids((1, c), seed=8)]
    canvas, sc = ids((1, c), seed=9), previous_logits((1, c), seed=10)
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    with torch.no_grad():
        for chunk in (prompt, *committed):
            ref.model.encoder(input_ids=chunk, cache=cache)
        expected = ref(cache=cache, decoder_input_ids=canvas, self_conditioning_logits=sc).logits
    ours_cache = ours.encode(prompt)
    for chunk in committed:
        assert ours.encode(chunk, ours_cache) is ours_cache
    assert ours_cache.length == 9 + 2 * c
    got = ours.denoise(ours_cache, canvas, sc)
    assert (got - expected).abs().max().item() <= TOL
