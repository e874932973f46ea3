"""The block-diffusion decoding rules, as pure functions.

- How many masked positions a denoising step accepts (threshold mode, steps mode, min/max steps).
- Which ones: the most confident, ties to the lower position.
- When a request is finished (EOS, stop string, max_tokens) and where its output is cut.
- How much decoded text may be streamed before the request is finished.

Every function works on whole batches of rows (tensors) or on one request's token list; the
scheduler and runner hold the state, these only decide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Confidence given to positions that are not masked, below any probability, so they sort last.
NOT_MASKED = -1.0


def unmask_counts(
    *,
    step: torch.Tensor,
    masked_now: torch.Tensor,
    masked_at_start: torch.Tensor,
    above_threshold: torch.Tensor,
    steps: torch.Tensor,
    min_steps: torch.Tensor,
    max_steps: torch.Tensor,
) -> torch.Tensor:
    """How many positions each row accepts at this denoising step; all arguments are (N,) long.

    `step` is the 0-based step index within the block; `steps` is 0 for threshold mode, else S;
    `max_steps` is 0 for "no bound". Rules:
    - steps mode: step k accepts m // S + (1 if k < m % S else 0) of the m masks the block
      started with, so it finishes in exactly S steps;
    - threshold mode: every position at or above the threshold, at least one; before step
      `min_steps`, at most ceil(r / (min_steps - k)) of the r masks left;
    - at step max_steps - 1 (the last allowed), every remaining mask.
    The result never exceeds the masks left.
    """
    one = torch.ones_like(masked_now)
    safe_steps = torch.where(steps > 0, steps, one)
    quota = masked_at_start // safe_steps + (step < masked_at_start % safe_steps).long()
    steps_left_to_min = (min_steps - step).clamp(min=1)
    cap = torch.where(
        step < min_steps,
        (masked_now + steps_left_to_min - 1) // steps_left_to_min,  # ceil(r / (min_steps - k))
        masked_now,
    )
    dynamic = torch.minimum(above_threshold.clamp(min=1), cap)
    count = torch.where(steps > 0, quota, dynamic)
    last_allowed = (max_steps > 0) & (step + 1 >= max_steps)
    count = torch.where(last_allowed, masked_now, count)
    return torch.minimum(count, masked_now)


def most_confident(confidence: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Boolean (N, B) selection of the `counts[i]` most confident positions of each row.

    Positions that are not masked must carry NOT_MASKED. Ties go to the lower position: the
    sort is stable, so equal confidences keep their position order.
    """
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return ranks < counts[:, None]


@dataclass(frozen=True)
class Finish:
    """Where a finished request's output ends."""

    num_tokens: int  # generated tokens kept (EOS excluded; a stop string's last token included)
    reason: str  # "stop" or "length"
    text_end: int | None = None  # the text is cut here (start of the stop string), else whole


def detect_finish(
    known: Sequence[int],
    *,
    max_tokens: int,
    eos_token_ids: frozenset[int],
    stop: Sequence[str],
    decode: Callable[[list[int]], str],
) -> Finish | None:
    """Decide whether a request is finished, given its generated tokens known so far.

    `known` is the longest unmasked prefix of the generated sequence (every position of it is
    final). The request finishes when that prefix holds an EOS or a stop string, or covers all
    `max_tokens` positions; the earliest of these wins.
    """
    limit = min(len(known), max_tokens)
    eos_at = next((i for i in range(limit) if known[i] in eos_token_ids), None)
    end = limit if eos_at is None else eos_at
    if stop:
        text = decode(list(known[:end]))
        hits = [(pos, s) for s in stop if (pos := text.find(s)) >= 0]
        if hits:
            pos, hit = min(hits)
            needed = pos + len(hit)
            # Keep tokens up to the one that completes the stop string.
            num = next(n for n in range(1, end + 1) if len(decode(list(known[:n]))) >= needed)
            return Finish(num_tokens=num, reason="stop", text_end=pos)
    if eos_at is not None:
        return Finish(num_tokens=eos_at, reason="stop")
    if len(known) >= max_tokens:
        return Finish(num_tokens=max_tokens, reason="length")
    return None


def releasable_text(text: str, *, finished: bool, stop: Sequence[str]) -> str:
    """The part of a request's decoded text that may be streamed now.

    Until the request finishes, hold back a trailing partial UTF-8 character (decoded as U+FFFD)
    and the last len(longest stop) - 1 characters, which could still turn out to start a stop
    string that the client must never see.
    """
    if finished:
        return text
    hold = max((len(s) for s in stop), default=1) - 1
    end = len(text) - hold
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    return text[: max(end, 0)]
