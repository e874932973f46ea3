"""Choosing a token for every masked position, and scoring it.

Scores: the mask token and vocabulary rows the tokenizer does not define get -inf before
anything else, so neither can ever be chosen. The confidence of a choice is its probability
under softmax of these raw logits (temperature, top-k, top-p and min-p shape only the draw).
A request's `min_tokens` adds its EOS and stop tokens to the -inf set at the positions before
`min_tokens`: they cannot be chosen there, like the mask token.

Randomness is per request: each request owns a `torch.Generator` seeded once, and draws from it
only for its own rows, in position order. A request's tokens therefore depend on its seed and
its own decoding path, never on which other requests share the batch.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from engine.params import MAX_SEED


@dataclass
class RowSampler:
    """The sampling settings of one request, with its private random stream."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None  # None for greedy requests: they draw nothing
    min_p: float = 0.0

    @classmethod
    def create(
        cls,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int | None,
        device: str,
        min_p: float = 0.0,
    ) -> RowSampler:
        """A sampler for one request; an unseeded sampling request gets a fresh random seed."""
        if temperature == 0:
            return cls(temperature=0.0, top_k=top_k, top_p=top_p, generator=None, min_p=min_p)
        generator = torch.Generator(device=device)
        generator.manual_seed(secrets.randbelow(MAX_SEED) if seed is None else seed)
        return cls(
            temperature=temperature, top_k=top_k, top_p=top_p, generator=generator, min_p=min_p
        )

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely token (temperature 0)."""
        return self.generator is None


def mask_invalid_rows(logits: torch.Tensor, mask_token_id: int, vocab_limit: int) -> torch.Tensor:
    """Set the mask token and ids >= vocab_limit to -inf, in place; returns `logits`."""
    logits[:, mask_token_id] = float("-inf")
    if vocab_limit < logits.shape[-1]:
        logits[:, vocab_limit:] = float("-inf")
    return logits


def _filter_top_k_top_p(
    scaled: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """Keep the k most likely tokens and the smallest set reaching mass top_p, then those at
    least min_p times as likely as the most likely one left (vLLM's order; -inf elsewhere)."""
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        mass_before = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
        mass_before = mass_before - torch.softmax(sorted_logits, dim=-1)
        # A token is dropped when the tokens ranked above it already reach top_p; the first
        # token always stays, so the draw never sees an empty distribution.
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); the top token always stays.
        floor = scaled.max(dim=-1, keepdim=True).values + math.log(min_p)
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    return scaled


def _draw(logits: torch.Tensor, sampler: RowSampler) -> torch.Tensor:
    """Sample one token per row with temperature, top-k and top-p from the request's stream."""
    scaled = _filter_top_k_top_p(
        logits / sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p
    )
    probs = torch.softmax(scaled, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is an exact draw from p, and never picks
    # a zero-probability token.
    race = torch.empty_like(probs).exponential_(generator=sampler.generator)
    return torch.argmax(probs / race, dim=-1)


def choose_tokens(
    logits: torch.Tensor,
    rows_per_request: list[int],
    samplers: list[RowSampler],
    *,
    mask_token_id: int,
    vocab_limit: int,
    banned: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick a token for every row of `logits` (R, V) and return (tokens, confidences), both (R,).

    Rows are grouped by request, in order: request i owns the next `rows_per_request[i]` rows
    and samples them with `samplers[i]`. `banned` = (rows, token ids), equal-length 1-D long
    tensors: those tokens cannot be chosen at those rows (`min_tokens`). fp32 `logits` are
    overwritten (scores are masked in place to spare a copy of a (R, V) tensor per step).
    """
    scores = mask_invalid_rows(logits.float(), mask_token_id, vocab_limit)
    if banned is not None:
        scores[banned] = float("-inf")
    tokens = torch.argmax(scores, dim=-1)  # greedy rows keep this; ties go to the lower id
    if not all(s.greedy for s in samplers):
        start = 0
        for count, sampler in zip(rows_per_request, samplers, strict=True):
            if count and not sampler.greedy:
                tokens[start : start + count] = _draw(scores[start : start + count], sampler)
            start += count
    log_norm = torch.logsumexp(scores, dim=-1)
    confidence = torch.exp(scores.gather(-1, tokens[:, None]).squeeze(-1) - log_norm)
    return tokens, confidence
