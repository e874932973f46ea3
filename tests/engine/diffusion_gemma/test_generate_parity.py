"""Our batch-1 DiffusionGemma generation loop, driving the `transformers` model, produces exactly
the tokens of that model's own `generate()` after `torch.manual_seed(seed)`: same forwards, same
random draws in the same order, same decisions (acceptance, renoising, early stop, EOS)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding
from engine.families.diffusion_gemma.generate import GenerationResult, generate
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


@pytest.fixture(scope="module")
def reference() -> DiffusionGemmaForBlockDiffusion:
    """The tiny random reference model (canvas 8, vocab 128)."""
    return tiny_reference_model()


def ours(
    model: DiffusionGemmaForBlockDiffusion,
    decoding: DiffusionGemmaDecoding,
    *,
    max_new_tokens: int,
    seed: int,
) -> GenerationResult:
    """Our generate() driving the reference model."""
    return generate(
        ReferenceDenoiser(model),
        PROMPT,
        decoding,
        max_new_tokens=max_new_tokens,
        seed=seed,
        vocab_size=VOCAB,
    )


SETTINGS = {
    # the reference's defaults, few steps: every canvas runs to the step limit
    "defaults": DiffusionGemmaDecoding(canvas_length=CANVAS, max_denoising_steps=6),
    # hot and wide schedule, several tokens accepted per step, stops after 1 stable step
    "hot": DiffusionGemmaDecoding(
        canvas_length=CANVAS,
        max_denoising_steps=12,
        t_min=0.0,
        t_max=2.5,
        entropy_bound=2.0,
        confidence_threshold=1.0,
    ),
    # everything accepted, cool: canvases settle and stop after 2 stable steps
    "settling": DiffusionGemmaDecoding(
        canvas_length=CANVAS,
        max_denoising_steps=12,
        t_min=0.0,
        t_max=0.3,
        entropy_bound=1000.0,
        stability_threshold=2,
        confidence_threshold=1.0,
    ),
    # the reference's temperatures and bound, early stop after 1 stable step
    "early_stop": DiffusionGemmaDecoding(
        canvas_length=CANVAS, max_denoising_steps=12, confidence_threshold=1.0
    ),
    # stability 0: a confident canvas stops at its first step
    "first_step": DiffusionGemmaDecoding(
        canvas_length=CANVAS,
        max_denoising_steps=5,
        stability_threshold=0,
        confidence_threshold=1000.0,
    ),
}


@pytest.mark.parametrize("seed", [0, 7])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_same_tokens_as_the_reference_generate(
    reference: DiffusionGemmaForBlockDiffusion, setting: str, seed: int
) -> None:
    decoding = SETTINGS[setting]
    max_new_tokens = 3 * CANVAS - 4  # three canvases, the last one cut
    expected = reference_generate(
        reference, PROMPT, decoding, max_new_tokens=max_new_tokens, seed=seed
    )
    got = ours(reference, decoding, max_new_tokens=max_new_tokens, seed=seed)

    assert got.canvas_ids == expected.sequences[0, len(PROMPT) :].tolist()
    assert got.token_ids == got.canvas_ids[:max_new_tokens]
    assert got.finish_reason == "length"
    # The reference reports tokens per decoder forward: the same number of denoising steps.
    decoder_forwards = sum(got.denoising_steps_per_block)
    assert len(got.canvas_ids) / decoder_forwards == pytest.approx(
        expected.tokens_per_forward.item()
    )
    assert got.forwards == decoder_forwards + len(got.denoising_steps_per_block)
    # Each setting reaches what it is here for: the step limit, the first step, early stops.
    steps = got.denoising_steps_per_block
    limit = decoding.max_denoising_steps
    if setting == "defaults":
        assert steps == [limit] * 3
    elif setting == "first_step":
        assert steps == [1] * 3
    else:
        assert min(steps) >= 2 and max(steps) <= limit and min(steps) < limit


@pytest.mark.parametrize("pad_token_id", [None, 0])
def test_a_canvas_with_eos_is_the_last_and_the_output_ends_at_eos(
    reference: DiffusionGemmaForBlockDiffusion, pad_token_id: int | None
) -> None:
    base = SETTINGS["early_stop"]
    free = ours(reference, base, max_new_tokens=4 * CANVAS, seed=3)
    # An EOS that first appears inside the second canvas, not at its end.
    eos = next(
        t for t in free.canvas_ids[CANVAS : 2 * CANVAS - 1] if t not in free.canvas_ids[:CANVAS]
    )
    first = free.canvas_ids.index(eos)
    decoding = replace(base.with_overrides(eos_token_ids=[eos]), pad_token_id=pad_token_id)

    expected = reference_generate(reference, PROMPT, decoding, max_new_tokens=4 * CANVAS, seed=3)
    got = ours(reference, decoding, max_new_tokens=4 * CANVAS, seed=3)

    reference_new = expected.sequences[0, len(PROMPT) :].tolist()
    assert len(got.canvas_ids) == len(reference_new) == 2 * CANVAS
    assert got.token_ids == free.canvas_ids[: first + 1]
    assert got.finish_reason == "stop"
    assert reference_new[: first + 1] == got.token_ids
    if pad_token_id is None:
        assert reference_new == got.canvas_ids
    else:
        assert reference_new[first + 1 :] == [pad_token_id] * (len(reference_new) - first - 1)


def test_an_eos_past_max_new_tokens_is_cut_away(
    reference: DiffusionGemmaForBlockDiffusion,
) -> None:
    base = SETTINGS["defaults"]
    free = ours(reference, base, max_new_tokens=CANVAS, seed=1)
    eos = free.canvas_ids[-1]
    assert eos not in free.canvas_ids[:-1], "the seed's canvas repeats its last token"
    got = ours(
        reference, base.with_overrides(eos_token_ids=[eos]), max_new_tokens=CANVAS - 1, seed=1
    )
    assert got.token_ids == free.canvas_ids[: CANVAS - 1]
    assert got.finish_reason == "length"
