"""One batched forward and what it decides: prefill writes, denoising with unmasking, commits.

The runner only reads requests; it returns plain per-request results (`RequestResult`) that
`EngineCore.update_from_output` applies.

Commit rule. The keys/values of a block's last denoising step are NOT final: with block-causal
attention every position of the block attends to the whole block, and at that step some
positions still held the mask token. So a finished block needs one more forward of its final
tokens with `write_cache=True`. We fuse that forward with the first denoising step of the next
block: the row is [final block | new block, all masked] (2B wide) at positions
committed .. committed + 2B. This is exact, not an approximation:
- the final block's queries see only the cache and their own block (block-causal: key block <=
  query block), never the new block, so every layer computes the same hidden states and K/V
  as a separate commit forward would, and those are what gets written;
- the new block's queries see the cache plus the final block's keys/values of this same call,
  which are those values — the same as reading them back from the cache after a separate commit.
The row also writes K/V of the still-masked new block at positions >= the new committed length;
they are never read (reads stop at `cache_lens`) and the block's own commit overwrites them.
The fused row stays within the slot: an unfinished request always has a next block inside its
padded length, which admission checked against `max_seq_len`. One forward per block saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.decoding import NOT_MASKED, most_confident, unmask_counts
from engine.kv_cache import KVCache
from engine.model import Model
from engine.params import SamplingParams
from engine.sampling import RowSampler, choose_tokens
from engine.scheduler import PrefillChunk, Request


@dataclass(frozen=True)
class RequestResult:
    """What one forward did for one request: plain data, applied by the engine core.

    A prefill forward writes `prefilled` prompt positions to the cache. A denoising forward
    commits the previous block first when the request had one pending (`committed_block`), then
    makes `tokens[i]` final at offset `unmasked[i]` of the current block (offsets ascending).
    """

    request_id: str
    prefilled: int = 0
    committed_block: bool = False
    denoised: bool = False
    unmasked: tuple[int, ...] = ()
    tokens: tuple[int, ...] = ()
    # A family's new private state for the request (DiffusionGemma's canvas), or None to keep
    # it as it was (SDAR keeps everything in the block's tokens and masks).
    state: Any = None


class ModelRunner:
    """The SDAR family's runner (`engine.families.base.FamilyRunner`): runs the model over
    groups of requests that share a block size; changes no request."""

    family = "sdar"
    aligned_prefill = True
    whole_prompt_prefill = False

    def __init__(
        self, model: Model, cache: KVCache, *, mask_token_id: int, vocab_limit: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.mask_token_id = mask_token_id
        self.placeholder_token_id = mask_token_id
        self.block_size = max(1, model.config.block_size)
        self.vocab_limit = vocab_limit
        self.device = cache.device

    def check_params(self, params: SamplingParams) -> None:
        """Every SamplingParams field is an SDAR rule: nothing more to refuse."""

    def start(self, request: Request) -> None:
        """The request's sampler: its temperature, top-k/p, min-p and private random stream."""
        params = request.params
        request.sampler = RowSampler.create(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            device=str(self.device),
            min_p=params.min_p,
        )

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> list[RequestResult]:
        """Write prompt chunks of equal length (whole blocks) into their slots."""
        length, block = chunks[0].length, chunks[0].request.block_size
        ids = [c.request.prompt_ids[c.start : c.start + length] for c in chunks]
        starts = self._long([c.start for c in chunks])
        positions = starts[:, None] + torch.arange(length, device=self.device)
        self.model(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            positions,
            block_size=block,
            cache=self.cache,
            slots=self._long([c.request.slot for c in chunks]),
            cache_lens=starts,
            write_cache=True,
            # Prefill needs no logits at all; one row per chunk (its last position) keeps the
            # LM head negligible while every layer still sees a non-empty row set.
            logits_rows=self._long([(i + 1) * length - 1 for i in range(len(chunks))]),
        )
        return [RequestResult(c.request.request_id, prefilled=length) for c in chunks]

    @torch.inference_mode()
    def decode(self, requests: Sequence[Request]) -> list[RequestResult]:
        """One denoising step for requests with the same block size and commit state.

        Either none or all of `requests` carry a finished previous block to commit (rows B or
        2B wide). Logits are computed only for masked positions; a token is chosen and scored
        for each, and the unmasking rules decide which become final.
        """
        block = requests[0].block_size
        fused = requests[0].pending_commit is not None
        rows = [r.block_tokens for r in requests]
        masked_rows = [r.block_masked for r in requests]
        if fused:
            rows = [(r.pending_commit or []) + row for r, row in zip(requests, rows, strict=True)]
            masked_rows = [[False] * block + row for row in masked_rows]
        tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
        masked = torch.tensor(masked_rows, dtype=torch.bool)
        width = tokens.shape[1]
        starts = self._long([r.committed for r in requests])
        logits = self.model(
            tokens,
            starts[:, None] + torch.arange(width, device=self.device),
            block_size=block,
            cache=self.cache,
            slots=self._long([r.slot for r in requests]),
            cache_lens=starts,
            write_cache=fused,
            logits_rows=masked.flatten().nonzero().squeeze(1).to(self.device),
        )

        # Rows of `logits` follow the flattened (request, position) order of masked positions.
        chosen, confidence = choose_tokens(
            logits,
            masked.sum(dim=1).tolist(),
            [_sampler(r) for r in requests],
            mask_token_id=self.mask_token_id,
            vocab_limit=self.vocab_limit,
            banned=self._min_tokens_bans(requests),
        )
        masked_dev = masked.to(self.device)
        full_conf = torch.full(masked.shape, NOT_MASKED, device=self.device)
        full_conf[masked_dev] = confidence
        full_tokens = tokens.clone()
        full_tokens[masked_dev] = chosen
        # Only the current block (the last `block` columns) has masked positions.
        block_conf, block_masked = full_conf[:, -block:], masked_dev[:, -block:]
        counts = self._unmask_counts(requests, block_conf, block_masked)
        accept = most_confident(block_conf, counts) & block_masked
        row_of, offset_of = accept.nonzero(as_tuple=True)  # row-major: offsets ascend per row
        chosen_tokens = full_tokens[:, -block:][row_of, offset_of].tolist()
        unmasked: list[list[int]] = [[] for _ in requests]
        final: list[list[int]] = [[] for _ in requests]
        for row, offset, token in zip(
            row_of.tolist(), offset_of.tolist(), chosen_tokens, strict=True
        ):
            unmasked[row].append(offset)
            final[row].append(token)
        return [
            RequestResult(
                r.request_id,
                committed_block=fused,
                denoised=True,
                unmasked=tuple(unmasked[i]),
                tokens=tuple(final[i]),
            )
            for i, r in enumerate(requests)
        ]

    def _min_tokens_bans(
        self, requests: Sequence[Request]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits rows, token ids) a request's `min_tokens` forbids: its stop tokens (EOS
        unless ignore_eos, and stop_token_ids) at masked positions before its min_tokens-th
        generated token. Rows follow `decode`'s order: requests, then masked block offsets."""
        rows: list[int] = []
        ids: list[int] = []
        row = 0
        for r in requests:
            banned = [t for t in r.stop_token_ids if t < self.vocab_limit]
            first_generated = r.block_start - r.prompt_len  # index of the block's offset 0
            for offset, masked in enumerate(r.block_masked):
                if not masked:
                    continue
                if banned and first_generated + offset < r.params.min_tokens:
                    rows += [row] * len(banned)
                    ids += banned
                row += 1
        if not rows:
            return None
        return self._long(rows), self._long(ids)

    def _unmask_counts(
        self, requests: Sequence[Request], confidence: torch.Tensor, masked: torch.Tensor
    ) -> torch.Tensor:
        params = [r.params for r in requests]
        thresholds = torch.tensor([p.threshold for p in params], device=self.device)
        above = ((confidence >= thresholds[:, None]) & masked).sum(dim=1)
        return unmask_counts(
            step=self._long([r.step_in_block for r in requests]),
            masked_now=masked.sum(dim=1),
            masked_at_start=self._long([r.masked_at_block_start for r in requests]),
            above_threshold=above,
            steps=self._long([p.steps or 0 for p in params]),
            min_steps=self._long([p.min_steps for p in params]),
            max_steps=self._long([p.max_steps or 0 for p in params]),
        )


def _sampler(request: Request) -> RowSampler:
    if request.sampler is None:  # `start` gives every SDAR request one before it is queued
        raise RuntimeError(f"request {request.request_id} was never started by its runner")
    return request.sampler
