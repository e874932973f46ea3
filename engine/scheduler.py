"""What runs next: admission into cache slots, chunked prefill, block lifecycle, cancellation.

KV cache memory is preallocated per slot (`KVCache(num_slots=max_batch_size, max_seq_len)`):
a running request owns one slot for its whole life, so there is no fragmentation, no page
table, and the bound is simply `max_batch_size` running requests; when every slot is taken new
requests wait in FIFO order. Admission already guaranteed that a request's padded length fits
in `max_seq_len`, so a slot can never overflow. (A paged cache would let short requests share
memory with long ones; with block-sized writes and bounded sequences the simpler scheme is
enough for now.)

A request's life: WAITING -> PREFILL (full prompt blocks written to the cache, in chunks) ->
DECODE (current block: denoising steps; a finished block is committed by the first step of the
next one, see engine/runner.py) -> finished (slot freed at once).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.params import SamplingParams
from engine.sampling import RowSampler


class Phase(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Request:
    """One request's decoding state; owned by the scheduler, advanced by the runner."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    block_size: int
    sampler: RowSampler
    arrival: float = field(default_factory=time.perf_counter)
    phase: Phase = Phase.WAITING
    slot: int = -1
    committed: int = 0  # positions [0, committed) of the slot hold final K/V
    # Final tokens of the previous block, fully unmasked but not yet in the cache (or None).
    # The current block starts right after them, at `block_start`.
    pending_commit: torch.Tensor | None = None
    # The current block (positions block_start .. block_start + block_size), kept on the CPU.
    block_tokens: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    block_masked: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.bool))
    masked_at_block_start: int = 0
    step_in_block: int = 0
    generated: list[int] = field(default_factory=list)  # tokens of committed/emitted blocks
    emitted_text: str = ""
    forwards: int = 0
    steps_per_block: list[int] = field(default_factory=list)
    first_block_at: float | None = None

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)

    @property
    def prefill_target(self) -> int:
        """Prompt positions that go to the cache before decoding: the full prompt blocks."""
        return self.prompt_len // self.block_size * self.block_size

    @property
    def block_start(self) -> int:
        """Absolute position of the current block's first token."""
        return self.committed + (0 if self.pending_commit is None else self.block_size)

    def start_block(self, mask_token_id: int) -> None:
        """Open the block at `block_start`: prompt tail kept, every other position masked."""
        width, start = self.block_size, self.block_start
        tokens = torch.full((width,), mask_token_id, dtype=torch.long)
        prompt_part = max(0, min(width, self.prompt_len - start))
        if prompt_part:
            tail = self.prompt_ids[start : start + prompt_part]
            tokens[:prompt_part] = torch.tensor(tail, dtype=torch.long)
        masked = torch.ones(width, dtype=torch.bool)
        masked[:prompt_part] = False
        self.block_tokens, self.block_masked = tokens, masked
        self.masked_at_block_start = width - prompt_part
        self.step_in_block = 0

    def finish_block(self, mask_token_id: int) -> None:
        """The current block is fully unmasked: queue it for commit and open the next one."""
        self.pending_commit = self.block_tokens
        self.start_block(mask_token_id)

    def block_generated(self) -> list[int]:
        """The generated part of the current block up to its first masked position."""
        start = max(0, self.prompt_len - self.block_start)
        masked = self.block_masked[start:].nonzero()
        end = start + (int(masked[0, 0]) if masked.numel() else self.block_size - start)
        return self.block_tokens[start:end].tolist()


@dataclass
class PrefillChunk:
    """Prompt positions [start, start + length) of one request, to be written to its slot."""

    request: Request
    start: int
    length: int


class Scheduler:
    """FIFO admission into a fixed number of cache slots, and the plan of each iteration."""

    def __init__(self, num_slots: int, *, prefill_budget: int = 512) -> None:
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        # Prompt tokens prefilled per iteration over all requests, so a long prompt is spread
        # over several iterations instead of stalling every running request's next step.
        self.prefill_budget = prefill_budget

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.running or any(r.request_id == request_id for r in self.waiting)

    def add(self, request: Request) -> None:
        """Queue a validated request."""
        self.waiting.append(request)

    def admit(self, mask_token_id: int) -> list[Request]:
        """Move waiting requests into free slots, oldest first; returns the admitted ones."""
        admitted = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop()
            request.committed = 0
            if request.prefill_target > 0:
                request.phase = Phase.PREFILL
            else:
                request.phase = Phase.DECODE
                request.start_block(mask_token_id)
            self.running[request.request_id] = request
            admitted.append(request)
        return admitted

    def remove(self, request_id: str) -> Request | None:
        """Take a request out (finished or aborted), freeing its slot at once."""
        request = self.running.pop(request_id, None)
        if request is not None:
            self.free_slots.append(request.slot)
            request.slot = -1
            return request
        for queued in self.waiting:
            if queued.request_id == request_id:
                self.waiting.remove(queued)
                return queued
        return None

    def prefill_chunks(self) -> list[PrefillChunk]:
        """This iteration's prompt chunks, whole blocks only, within the token budget.

        The oldest prefilling request always gets at least one block so prefill progresses
        however small the budget.
        """
        chunks: list[PrefillChunk] = []
        budget = self.prefill_budget
        for request in self.running.values():
            if request.phase is not Phase.PREFILL:
                continue
            remaining = request.prefill_target - request.committed
            length = min(remaining, budget // request.block_size * request.block_size)
            if length <= 0:
                if chunks:
                    break
                length = request.block_size
            chunks.append(PrefillChunk(request, request.committed, length))
            budget -= length
        return chunks

    def decoding(self) -> list[Request]:
        """Requests with a block to denoise or commit this iteration."""
        return [r for r in self.running.values() if r.phase is Phase.DECODE]

    @property
    def num_running(self) -> int:
        """Requests holding a cache slot."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self.waiting)

    def committed_tokens(self) -> int:
        """Positions holding final K/V across all slots."""
        return sum(r.committed for r in self.running.values())
