"""What runs next: admission into cache slots, chunked prefill, the plan of each iteration.

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

The scheduler owns the queues and the slots, and plans each iteration (`schedule`); it never
changes a request's decoding state. The runner executes the plan and returns plain results,
and `EngineCore.update_from_output` alone applies them to the requests.
"""

from __future__ import annotations

import enum
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.params import SamplingParams
from engine.sampling import RowSampler


class Phase(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Request:
    """One request's state, created by `EngineCore.add_request`. Its queue and slot are the
    scheduler's; every other field changes only in `EngineCore.update_from_output` (the runner
    only reads it)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    block_size: int
    detokenizer: IncrementalDetokenizer  # the emitted tokens and their text
    # The family's per-request decoding state, set by its runner's `start`: SDAR's sampler, or
    # DiffusionGemma's canvas (replaced only through `RequestResult.state`).
    sampler: RowSampler | None = None
    state: Any = None
    # Prefill caches whole prompt blocks (SDAR) or the whole prompt (a canvas family), and may
    # be chunked unless the family's encoder must see the prompt at once.
    aligned_prefill: bool = True
    whole_prompt_prefill: bool = False
    # Tokens that end it (EOS unless ignore_eos, and its stop_token_ids); with min_tokens,
    # the ones the runner forbids at the first min_tokens positions.
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = field(default_factory=time.perf_counter)
    slot: int = -1  # the cache slot while running, else -1
    committed: int = 0  # positions [0, committed) of the slot hold final K/V
    # Final tokens of the previous block, fully unmasked but not yet in the cache (or None).
    # The current block starts right after them, at `block_start`.
    pending_commit: list[int] | None = None
    # The current block (positions block_start .. block_start + block_size).
    block_tokens: list[int] = field(default_factory=list)
    block_masked: list[bool] = field(default_factory=list)
    masked_at_block_start: int = 0
    step_in_block: int = 0
    emitted_chars: int = 0  # characters of the detokenizer's text already sent
    forwards: int = 0
    steps_per_block: list[int] = field(default_factory=list)
    first_block_at: float | None = None
    admitted_at: float | None = None  # when it got a slot: arrival to here is its queue wait

    @property
    def phase(self) -> Phase:
        """Waiting for a slot, prefilling its prompt, or decoding (it follows from the state)."""
        if self.slot < 0:
            return Phase.WAITING
        return Phase.PREFILL if self.committed < self.prefill_target else Phase.DECODE

    @property
    def generated(self) -> list[int]:
        """Tokens of the emitted blocks (do not modify)."""
        return self.detokenizer.token_ids

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)

    @property
    def prefill_target(self) -> int:
        """Prompt positions that go to the cache before decoding: the full prompt blocks, or
        the whole prompt for a family whose blocks follow it."""
        if not self.aligned_prefill:
            return self.prompt_len
        return self.prompt_len // self.block_size * self.block_size

    @property
    def block_start(self) -> int:
        """Absolute position of the current block's first token."""
        return self.committed + (0 if self.pending_commit is None else self.block_size)

    def open_block(self, start: int, mask_token_id: int) -> None:
        """Make the block at `start` current: prompt tail kept, every other position masked."""
        width = self.block_size
        prompt_part = max(0, min(width, self.prompt_len - start))
        self.block_tokens = self.prompt_ids[start : start + prompt_part]
        self.block_tokens += [mask_token_id] * (width - prompt_part)
        self.block_masked = [False] * prompt_part + [True] * (width - prompt_part)
        self.masked_at_block_start = width - prompt_part
        self.step_in_block = 0

    def block_generated(self) -> list[int]:
        """The generated part of the current block up to its first masked position."""
        start = max(0, self.prompt_len - self.block_start)
        masked = self.block_masked
        end = next((i for i in range(start, self.block_size) if masked[i]), self.block_size)
        return self.block_tokens[start:end]


@dataclass
class PrefillChunk:
    """Prompt positions [start, start + length) of one request, to be written to its slot."""

    request: Request
    start: int
    length: int


@dataclass
class SchedulerOutput:
    """The plan of one iteration: the forwards to run, in order.

    Prefill forwards come first; a request whose last prompt chunk is among them also takes
    its first denoising step in this iteration's decode forwards.
    """

    prefills: list[list[PrefillChunk]]  # one forward each: chunks of one length and block size
    decodes: list[list[Request]]  # one forward each: one block size and commit state (B or 2B)

    @property
    def num_requests(self) -> int:
        """Requests that take part in a forward."""
        ids = {c.request.request_id for chunks in self.prefills for c in chunks}
        ids.update(r.request_id for group in self.decodes for r in group)
        return len(ids)


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

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots, oldest first; returns the admitted ones."""
        admitted = []
        while self.waiting and self.free_slots:
            request = self.waiting.popleft()
            request.slot = self.free_slots.pop()
            request.admitted_at = time.perf_counter()
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

    def schedule(self) -> SchedulerOutput:
        """Admit what fits, then plan this iteration's forwards."""
        self.admit()
        chunks = self.prefill_chunks()
        prefills: dict[tuple[int, int], list[PrefillChunk]] = defaultdict(list)
        for chunk in chunks:
            prefills[(chunk.length, chunk.request.block_size)].append(chunk)
        prefilled = {
            c.request.request_id for c in chunks if c.start + c.length >= c.request.prefill_target
        }
        # Rows of one forward share a width: B, or 2B when they also commit their last block.
        decodes: dict[tuple[int, bool], list[Request]] = defaultdict(list)
        for request in self.running.values():
            if request.phase is Phase.DECODE or request.request_id in prefilled:
                decodes[(request.block_size, request.pending_commit is not None)].append(request)
        return SchedulerOutput(list(prefills.values()), list(decodes.values()))

    def prefill_chunks(self) -> list[PrefillChunk]:
        """This iteration's prompt chunks, whole blocks only (or the whole prompt, for a family
        that caches it whole), within the token budget.

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
            if request.whole_prompt_prefill:
                length = remaining if remaining <= budget or not chunks else 0
            if length <= 0:
                if chunks:
                    break
                length = min(remaining, request.block_size)
            chunks.append(PrefillChunk(request, request.committed, length))
            budget -= length
        return chunks

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
