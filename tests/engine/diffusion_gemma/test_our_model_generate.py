"""Our DiffusionGemma model, loaded by `engine.load_model` from a `save_pretrained` checkpoint
of the tiny reference model, generates exactly the reference's tokens under our `generate()`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import engine
from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding
from engine.families.diffusion_gemma.generate import generate
from tests.engine.diffusion_gemma.reference_generation import (
    CANVAS,
    PROMPT,
    VOCAB,
    ReferenceDenoiser,
    reference_generate,
    tiny_reference_model,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls on one thread: splitting them only adds synchronisation on a loaded CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize(
    "decoding",
    [
        DiffusionGemmaDecoding(canvas_length=CANVAS, max_denoising_steps=6),
        DiffusionGemmaDecoding(
            canvas_length=CANVAS,
            max_denoising_steps=12,
            t_min=0.0,
            t_max=2.5,
            entropy_bound=2.0,
            confidence_threshold=1.0,
        ),
        DiffusionGemmaDecoding(
            canvas_length=CANVAS, max_denoising_steps=12, confidence_threshold=1.0
        ),
    ],
    ids=["defaults", "hot", "early_stop"],
)
def test_our_model_generates_the_reference_tokens(
    tmp_path: Path, decoding: DiffusionGemmaDecoding, seed: int
) -> None:
    reference = tiny_reference_model()
    reference.save_pretrained(tmp_path)
    ours = engine.load_model(tmp_path, dtype=torch.float32)
    max_new_tokens = 3 * CANVAS - 4

    expected = reference_generate(
        reference, PROMPT, decoding, max_new_tokens=max_new_tokens, seed=seed
    )
    got = generate(
        ours, PROMPT, decoding, max_new_tokens=max_new_tokens, seed=seed, vocab_size=VOCAB
    )
    driven = generate(
        ReferenceDenoiser(reference),
        PROMPT,
        decoding,
        max_new_tokens=max_new_tokens,
        seed=seed,
        vocab_size=VOCAB,
    )

    assert got.canvas_ids == expected.sequences[0, len(PROMPT) :].tolist()
    assert got.denoising_steps_per_block == driven.denoising_steps_per_block
    assert got.forwards == driven.forwards
