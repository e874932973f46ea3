"""The block-diffusion decoding rules, as pure functions.

- How many masked positions a denoising step accepts (threshold mode, steps mode, min/max steps).
- Which ones: the most confident, ties to the lower position.
- When a request is finished (EOS, stop string, max_tokens) and where its output is cut.
- How much decoded text may be streamed before the request is finished.

Every function works on whole batches of rows (tensors) or on one request's tokens; the engine
core holds the state and applies what these decide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.detokenizer import StopHit

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


# Finds the earliest stop string in the text of the tokens before `new_known` plus the given
# ones (an IncrementalDetokenizer's `find_stop`, with the request's stop strings bound).
StopFinder = Callable[[Sequence[int]], StopHit | None]


def detect_finish(
    generated: int,
    new_known: Sequence[int],
    *,
    max_tokens: int,
    eos_token_ids: frozenset[int],
    find_stop: StopFinder | None,
) -> Finish | None:
    """Decide whether a request is finished, given its generated tokens known so far.

    The known tokens are the longest unmasked prefix of the generated sequence (every position
    of it is final): `generated` tokens already emitted (none of them EOS, fewer than
    `max_tokens`), then `new_known`. The request finishes when that prefix holds an EOS or a
    stop string, or covers all `max_tokens` positions; the earliest of these wins. Stop strings
    are looked for in the text before the first EOS and `max_tokens`.
    """
    limit = min(len(new_known), max_tokens - generated)
    eos_at = next((i for i in range(limit) if new_known[i] in eos_token_ids), None)
    end = limit if eos_at is None else eos_at
    if find_stop is not None and (hit := find_stop(new_known[:end])) is not None:
        return Finish(num_tokens=hit.num_tokens, reason="stop", text_end=hit.text_end)
    if eos_at is not None:
        return Finish(num_tokens=generated + eos_at, reason="stop")
    if generated + len(new_known) >= max_tokens:
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
