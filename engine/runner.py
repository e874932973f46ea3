"""One batched forward and what follows it: prefill writes, denoising with unmasking, commits.

Commit rule. The keys/values of a block's last denoising step are NOT final: with block-causal
attention every position of the block attends to the whole block, and at that step some
positions still held the mask token. So a finished block is committed with one extra forward of
its final tokens (`write_cache=True`, no logits). That commit rides in the same forward as the
other requests' denoising steps of the same block size: their rows also write K/V, but only at
positions >= their `cache_lens`, which are never read and which their own commit overwrites.
(Fusing the commit with the same request's next first step would save one forward per block
but needs 2B-wide rows; not done.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.decoding import NOT_MASKED, most_confident, unmask_counts
from engine.kv_cache import KVCache
from engine.model import Model
from engine.sampling import choose_tokens
from engine.scheduler import PrefillChunk, Request


@dataclass
class DecodeOutcome:
    """What one decoding forward did: committed requests, and tokens unmasked per request."""

    committed: list[Request]
    denoised: list[Request]
    tokens_unmasked: int


class ModelRunner:
    """Runs the model over groups of requests that share a block size."""

    def __init__(
        self, model: Model, cache: KVCache, *, mask_token_id: int, vocab_limit: int
    ) -> None:
        self.model = model
        self.cache = cache
        self.mask_token_id = mask_token_id
        self.vocab_limit = vocab_limit
        self.device = cache.device

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> None:
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
            logits_rows=self._long([]),
        )
        for chunk in chunks:
            chunk.request.committed += length
            chunk.request.forwards += 1

    @torch.inference_mode()
    def decode(self, requests: Sequence[Request]) -> DecodeOutcome:
        """One forward for requests with the same block size: commits and denoising steps.

        Denoising rows get logits only for their masked positions; a token is chosen and scored
        for each, and the unmasking rules decide which become final.
        """
        block = requests[0].block_size
        tokens = torch.stack([r.block_tokens for r in requests])
        masked = torch.stack([r.block_masked for r in requests])
        starts = self._long([r.committed for r in requests])
        committing = [r for r in requests if r.needs_commit]
        denoising = [r for r in requests if not r.needs_commit]
        flat_rows = masked.flatten().nonzero().squeeze(1)
        logits = self.model(
            tokens.to(self.device),
            starts[:, None] + torch.arange(block, device=self.device),
            block_size=block,
            cache=self.cache,
            slots=self._long([r.slot for r in requests]),
            cache_lens=starts,
            write_cache=bool(committing),
            logits_rows=flat_rows.to(self.device),
        )
        for request in requests:
            request.forwards += 1
        for request in committing:
            request.committed += block
        if not denoising:
            return DecodeOutcome(committing, [], 0)

        # Rows of `logits` follow the flattened (request, position) order of masked positions;
        # committing rows have no masked positions, so they contribute no rows.
        rows_per_request = masked.sum(dim=1).tolist()
        chosen, confidence = choose_tokens(
            logits,
            rows_per_request,
            [r.sampler for r in requests],
            mask_token_id=self.mask_token_id,
            vocab_limit=self.vocab_limit,
        )
        masked_dev = masked.to(self.device)
        full_conf = torch.full(masked.shape, NOT_MASKED, device=self.device)
        full_conf[masked_dev] = confidence
        full_tokens = tokens.to(self.device).clone()
        full_tokens[masked_dev] = chosen
        counts = self._unmask_counts(requests, full_conf, masked_dev)
        accept = most_confident(full_conf, counts) & masked_dev
        new_tokens = torch.where(accept, full_tokens, tokens.to(self.device)).cpu()
        accept_cpu = accept.cpu()
        for i, request in enumerate(requests):
            if request.needs_commit:
                continue
            request.block_tokens = new_tokens[i]
            request.block_masked = request.block_masked & ~accept_cpu[i]
            request.step_in_block += 1
        return DecodeOutcome(committing, denoising, int(accept_cpu.sum()))

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
