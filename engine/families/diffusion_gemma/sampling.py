"""DiffusionGemma's decoding policy as pure, batched rules: data in, decision out, no model.

A canvas starts as uniform noise. Each denoising step (`denoising_step` runs them in this order):
1. the raw logits are divided by the step's temperature (a linear schedule, `step_temperatures`);
2. every position draws a token from the softmax of those (`sample_denoiser_canvas`);
3. the lowest-entropy draws are accepted while sum(H) - max(H) <= entropy_bound
   (`entropy_bound_acceptance`), the others are replaced by fresh noise (`renoise_canvas`);
4. the canvas stops early once its argmax is stable and its mean entropy is low
   (`stable_and_confident`), else after `max_denoising_steps`; it commits its argmax.
The scaled logits are the next step's self-conditioning input.

Randomness is per request: every row draws from its own `torch.Generator`, on the generator's
device, so one request's tokens never depend on which others share the batch. A row draws in
the reference's order — a canvas of noise when the canvas starts, then per step a categorical
draw for every position followed by a whole canvas of noise — so at batch 1 a generator seeded
with `manual_seed(s)` makes exactly the draws `transformers`' `generate()` makes after
`torch.manual_seed(s)` (CPU). The arithmetic (float32 temperature, entropy, comparisons) is the
reference's too, bit for bit, so its decisions are ours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding


def step_temperatures(
    decodings: Sequence[DiffusionGemmaDecoding], steps_taken: Sequence[int]
) -> torch.Tensor:
    """(B,) float32 temperature of each row's next denoising step.

    A row that has taken k of its N steps runs at t_min + (t_max - t_min) * (N - k) / N: t_max
    at the first step, t_min + (t_max - t_min) / N at the last. Computed in float32 from the
    difference t_max - t_min formed in double, as the reference's schedule does, so the values
    are its values to the bit.
    """
    t_min = torch.tensor([d.t_min for d in decodings], dtype=torch.float32)
    span = torch.tensor([d.t_max - d.t_min for d in decodings], dtype=torch.float32)
    steps = torch.tensor([d.max_denoising_steps for d in decodings], dtype=torch.float32)
    remaining = torch.tensor(
        [d.max_denoising_steps - k for d, k in zip(decodings, steps_taken, strict=True)],
        dtype=torch.float32,
    )
    return t_min + span * (remaining / steps)


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """(B, L, V) logits divided by each row's temperature ((B,))."""
    return logits / temperatures.to(device=logits.device, dtype=logits.dtype)[:, None, None]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, L) entropy (nats) of the categorical distribution each position's logits define.

    Formed as torch.distributions.Categorical forms it (normalise in log space, clamp -inf to
    the dtype's lowest value so 0 * log 0 is 0), so the acceptance and stopping rules compare
    the same numbers the reference compares.
    """
    log_probs = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(log_probs, dim=-1)
    clamped = torch.clamp(log_probs, min=torch.finfo(log_probs.dtype).min)
    return -(clamped * probs).sum(-1)


def entropy_bound_acceptance(entropy: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the positions whose denoiser draw a step accepts.

    Per row, positions in increasing entropy are accepted while the sum of the accepted
    entropies minus the largest of them stays <= the row's bound ((B,)): an upper bound on
    the mutual information between the accepted tokens, so they are near independent. The
    lowest-entropy position is always accepted (its term is 0).
    """
    ascending, order = torch.sort(entropy, dim=-1, descending=False)
    # Sorted ascending, so each prefix's largest entropy is its last one.
    within = (
        torch.cumsum(ascending, dim=-1) - ascending
        <= bounds.to(device=entropy.device, dtype=entropy.dtype)[:, None]
    )
    return torch.zeros_like(within).scatter(-1, order, within)


def initial_canvas(
    generators: Sequence[torch.Generator],
    canvas_length: int,
    vocab_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(B, canvas_length) long: uniform-noise tokens in [0, vocab_size), row i drawn from
    generators[i] (on that generator's device), then moved to DEVICE (default: the first
    generator's)."""
    rows = [
        torch.randint(0, vocab_size, (canvas_length,), generator=g, device=g.device)
        for g in generators
    ]
    target = generators[0].device if device is None else device
    return torch.stack(rows).to(target)


def sample_denoiser_canvas(
    probs: torch.Tensor, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """(B, L) long: one token per position drawn from PROBS ((B, L, V)), row i from
    generators[i] (which must live on PROBS' device), positions in order."""
    rows = [
        torch.multinomial(probs[i], num_samples=1, generator=g).squeeze(-1)
        for i, g in enumerate(generators)
    ]
    return torch.stack(rows)


def renoise_canvas(
    accepted_canvas: torch.Tensor,
    accepted_mask: torch.Tensor,
    generators: Sequence[torch.Generator],
    vocab_size: int,
) -> torch.Tensor:
    """(B, L): the accepted tokens kept, every other position fresh uniform noise.

    Each row draws a whole canvas of noise from its generator even where everything was
    accepted, as the reference does: that keeps the row's random stream aligned with it.
    """
    noise = initial_canvas(
        generators, accepted_canvas.shape[1], vocab_size, device=accepted_canvas.device
    )
    return torch.where(accepted_mask, accepted_canvas, noise)


@dataclass(frozen=True)
class CanvasStability:
    """One request's stop state within its current canvas (a fresh one per canvas).

    `last_argmax` is the previous step's argmax canvas ((L,); None before the first step) and
    `unchanged_steps` how many steps in a row the argmax has equalled the step before's.
    """

    last_argmax: torch.Tensor | None = None
    unchanged_steps: int = 0


def stable_and_confident(
    argmax_canvas: torch.Tensor,
    entropy: torch.Tensor,
    stability: Sequence[CanvasStability],
    stability_thresholds: torch.Tensor,
    confidence_thresholds: torch.Tensor,
) -> tuple[list[bool], list[CanvasStability]]:
    """Whether each row's canvas stops now, and the rows' new stability states.

    A row stops when its argmax canvas ((B, L)) has been the same for the last S steps before
    this one too (S = its stability threshold; S = 0: always stable; never before step S + 1)
    and the mean over positions of its token entropies ((B, L)) is below its confidence
    threshold. Thresholds are (B,) tensors.
    """
    # Argmax tokens are >= 0, so a row with no previous step never counts as unchanged.
    no_previous = torch.full_like(argmax_canvas[0], -1)
    previous = torch.stack(
        [no_previous if s.last_argmax is None else s.last_argmax for s in stability]
    )
    counts = torch.tensor([s.unchanged_steps for s in stability], device=argmax_canvas.device)
    unchanged = torch.where((previous == argmax_canvas).all(dim=-1), counts + 1, 0)
    stable = unchanged >= stability_thresholds.to(argmax_canvas.device)
    confident = entropy.mean(dim=-1) < confidence_thresholds.to(
        device=entropy.device, dtype=entropy.dtype
    )
    states = [
        CanvasStability(last_argmax=argmax_canvas[i], unchanged_steps=n)
        for i, n in enumerate(unchanged.tolist())
    ]
    return (stable & confident).tolist(), states


@dataclass(frozen=True)
class DenoisingStep:
    """What one denoising step decided for a batch of canvases."""

    next_canvas: torch.Tensor  # (B, L): the decoder's next input (accepted tokens + noise)
    argmax_canvas: torch.Tensor  # (B, L): each position's most likely token; what a canvas commits
    self_conditioning_logits: torch.Tensor  # (B, L, V): the scaled logits, the next step's input
    accepted: torch.Tensor  # (B, L) bool: positions that took the denoiser's draw
    stability: list[CanvasStability]  # the rows' new stop states
    finished: list[bool]  # stable and confident, or the row's last allowed step


def denoising_step(
    logits: torch.Tensor,
    canvas: torch.Tensor,
    *,
    decodings: Sequence[DiffusionGemmaDecoding],
    steps_taken: Sequence[int],
    generators: Sequence[torch.Generator],
    stability: Sequence[CanvasStability],
) -> DenoisingStep:
    """Applies the rules, in the reference's order, to the decoder's raw LOGITS ((B, L, V))
    for the CANVAS ((B, L)) it was given; row i follows decodings[i], has taken steps_taken[i]
    steps of this canvas and draws from generators[i]."""
    scaled = apply_temperature(logits, step_temperatures(decodings, steps_taken))
    probs = torch.softmax(scaled, dim=-1, dtype=torch.float32)
    drawn = sample_denoiser_canvas(probs, generators)
    argmax = torch.argmax(scaled, dim=-1)
    entropy = token_entropy(scaled)
    bounds = torch.tensor([d.entropy_bound for d in decodings], dtype=torch.float32)
    accepted = entropy_bound_acceptance(entropy, bounds)
    next_canvas = renoise_canvas(
        torch.where(accepted, drawn, canvas), accepted, generators, logits.shape[-1]
    )
    stop, states = stable_and_confident(
        argmax,
        entropy,
        stability,
        torch.tensor([d.stability_threshold for d in decodings]),
        torch.tensor([d.confidence_threshold for d in decodings], dtype=torch.float32),
    )
    last = [k + 1 >= d.max_denoising_steps for d, k in zip(decodings, steps_taken, strict=True)]
    return DenoisingStep(
        next_canvas=next_canvas,
        argmax_canvas=argmax,
        self_conditioning_logits=scaled,
        accepted=accepted,
        stability=states,
        finished=[s or end for s, end in zip(stop, last, strict=True)],
    )
