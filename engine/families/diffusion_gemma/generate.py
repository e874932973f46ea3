"""DiffusionGemma generation for one request, in the reference's order: the yardstick that the
batched engine and our model are held to (`transformers`' `DiffusionGemmaForBlockDiffusion.
generate()` makes exactly these forwards and draws at batch 1).

    encode the prompt into the cache
    for each canvas (at most ceil(max_new_tokens / canvas_length)):
        encode the previous canvas into the cache (not before the first)
        canvas = uniform noise
        for each step (at most max_denoising_steps):
            logits = denoise(cache, canvas, self-conditioning = the previous step's scaled logits)
            canvas, argmax, stop = sampling.denoising_step(...)
            stop early when stable and confident
        commit the last step's argmax canvas
        stop when it holds an EOS

Output: the committed canvases cut after the first EOS (the reference pads the rest, or keeps it
when it has no pad id) and to `max_new_tokens` (the reference returns whole canvases).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from engine.errors import InvalidParams
from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding
from engine.families.diffusion_gemma.sampling import (
    CanvasStability,
    denoising_step,
    initial_canvas,
)


class Denoiser(Protocol):
    """The two forwards of a DiffusionGemma model, for one sequence (batch 1)."""

    def encode(self, ids: torch.Tensor, cache: Any = None) -> Any:
        """Appends IDS ((1, n) long, after what CACHE holds; None: a fresh cache) to the
        cache and returns it."""
        ...

    def denoise(
        self,
        cache: Any,
        canvas_ids: torch.Tensor,
        self_conditioning_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(1, L, V) float32 soft-capped logits for CANVAS_IDS ((1, L)) placed after the cache.

        SELF_CONDITIONING_LOGITS are the previous step's temperature-scaled float32 logits
        (None at a canvas's first step); the denoiser casts them to its embedding dtype before
        their softmax, as the reference's generate() does.
        """
        ...


@dataclass(frozen=True)
class GenerationResult:
    """One request's generation."""

    token_ids: list[int]  # generated tokens: through the first EOS, at most max_new_tokens
    finish_reason: Literal["stop", "length"]  # stop: an EOS was generated
    canvas_ids: list[int]  # every committed canvas, whole: what the reference appends
    denoising_steps_per_block: list[int]  # denoiser forwards of each canvas
    forwards: int  # model forwards: the prompt's and each later canvas's encode + every denoise


def generate(
    model: Denoiser,
    prompt_ids: Sequence[int],
    decoding: DiffusionGemmaDecoding,
    *,
    max_new_tokens: int,
    seed: int,
    vocab_size: int,
    eos_token_ids: Collection[int] | None = None,
    device: torch.device | str = "cpu",
) -> GenerationResult:
    """Generates after PROMPT_IDS with MODEL, drawing from one generator seeded with SEED.

    EOS_TOKEN_IDS default to the decoding's. With the same seed, settings and weights this is
    the reference's `torch.manual_seed(seed); model.generate(...)` at batch 1 on the CPU.
    """
    if not prompt_ids:
        raise InvalidParams("prompt", "prompt: at least one token is needed to condition on")
    if max_new_tokens < 1:
        raise InvalidParams("max_tokens", f"max_tokens must be >= 1, got {max_new_tokens}")
    eos = set(decoding.eos_token_ids if eos_token_ids is None else eos_token_ids)
    generators = [torch.Generator(device=device).manual_seed(seed)]
    length = decoding.canvas_length
    canvases: list[list[int]] = []
    steps_per_block: list[int] = []
    with torch.no_grad():
        cache = model.encode(torch.tensor([list(prompt_ids)], device=device))
        forwards = 1
        for _ in range(math.ceil(max_new_tokens / length)):
            if canvases:
                # The committed canvas joins the context only when another canvas follows.
                cache = model.encode(torch.tensor([canvases[-1]], device=device), cache)
                forwards += 1
            committed, steps = _denoise_canvas(
                model, cache, decoding, generators, vocab_size, device
            )
            forwards += steps
            canvases.append(committed)
            steps_per_block.append(steps)
            if eos.intersection(committed):
                break
    generated = [t for canvas in canvases for t in canvas]
    end = next((i + 1 for i, t in enumerate(generated) if t in eos), None)
    stopped = end is not None and end <= max_new_tokens
    return GenerationResult(
        token_ids=generated[: end if stopped else max_new_tokens],
        finish_reason="stop" if stopped else "length",
        canvas_ids=generated,
        denoising_steps_per_block=steps_per_block,
        forwards=forwards,
    )


def _denoise_canvas(
    model: Denoiser,
    cache: Any,
    decoding: DiffusionGemmaDecoding,
    generators: list[torch.Generator],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[list[int], int]:
    """Denoises one canvas from noise; returns its committed tokens and the steps it took."""
    canvas = initial_canvas(generators, decoding.canvas_length, vocab_size, device=device)
    self_conditioning: torch.Tensor | None = None
    stability = [CanvasStability()]
    for step in range(decoding.max_denoising_steps):
        logits = model.denoise(cache, canvas, self_conditioning)
        decided = denoising_step(
            logits,
            canvas,
            decodings=[decoding],
            steps_taken=[step],
            generators=generators,
            stability=stability,
        )
        canvas, self_conditioning = decided.next_canvas, decided.self_conditioning_logits
        stability = decided.stability
        if decided.finished[0]:
            break
    return decided.argmax_canvas[0].tolist(), step + 1
