"""EngineCore: the synchronous decoding loop — schedule, execute, update — owned by one thread.

Each `step()` is one scheduling iteration: admit waiting requests into free cache slots,
prefill a budget of prompt chunks, then one forward per block size that carries every running
request's current block: a denoising step, fused with the commit of the previous block when that
one just finished (rows of width 2B then go in their own forward). Requests that finish leave
at once and free their slot for the next iteration.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from engine.decoding import detect_finish, releasable_text
from engine.errors import EngineError, InvalidParams
from engine.kv_cache import KVCache
from engine.model import Model
from engine.params import SamplingParams
from engine.runner import ModelRunner
from engine.sampling import RowSampler
from engine.scheduler import Phase, PrefillChunk, Request, Scheduler
from engine.tokenizer import Tokenizer


@dataclass
class RequestStats:
    """How a finished request was decoded."""

    prompt_tokens: int
    completion_tokens: int
    forwards: int  # forwards the request took part in: prefill chunks, denoising steps, commits
    steps_per_block: list[int]  # denoising steps of each decoded block
    tokens_per_forward: float  # completion_tokens / forwards
    time_to_first_block_s: float
    e2e_s: float


@dataclass
class RequestUpdate:
    """New output of one request: a committed block, and/or its end."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stats: RequestStats | None  # set on the finishing update


@dataclass
class StepStats:
    """What the last `step()` did."""

    batch_size: int = 0  # requests that took part in a forward
    forwards: int = 0
    tokens_unmasked: int = 0


class EngineCore:
    """Continuous-batching block-diffusion decoder over a preallocated per-slot KV cache."""

    def __init__(
        self, model: Model, tokenizer: Tokenizer, *, max_batch_size: int, max_seq_len: int
    ) -> None:
        config = model.config
        mask_id = config.mask_token_id
        if mask_id is None:
            mask_id = tokenizer.mask_token_id
        if mask_id is None:
            raise EngineError(
                f"the checkpoint ({config.model_type}) names no mask token, so it cannot run "
                "block-diffusion decoding; set mask_token_id in config.json"
            )
        if max_batch_size < 1 or max_seq_len < 1:
            raise InvalidParams(
                "max_batch_size" if max_batch_size < 1 else "max_seq_len",
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}",
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.default_block_size = max(1, config.block_size)
        self.mask_token_id = mask_id
        self.eos_token_ids = frozenset(config.eos_token_ids or tokenizer.eos_token_ids)
        self.cache = KVCache(
            config, max_batch_size, max_seq_len, dtype=model.dtype, device=model.device
        )
        self.runner = ModelRunner(
            model,
            self.cache,
            mask_token_id=mask_id,
            vocab_limit=min(tokenizer.vocab_size, config.vocab_size),
        )
        self.scheduler = Scheduler(max_batch_size)
        self._aborts: list[str] = []
        self.last_step = StepStats()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Validate and queue a request; raises InvalidParams / ContextLengthExceeded."""
        if request_id in self.scheduler:
            raise InvalidParams("request_id", f"request id {request_id!r} is already in use")
        params.validate(self.max_seq_len, len(prompt_token_ids), self.default_block_size)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParams("prompt", f"prompt token ids must be in [0, {vocab}), got {bad[0]}")
        sampler = RowSampler.create(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            device=str(self.model.device),
        )
        self.scheduler.add(
            Request(
                request_id=request_id,
                prompt_ids=list(prompt_token_ids),
                params=params,
                block_size=params.resolved_block_size(self.default_block_size),
                sampler=sampler,
            )
        )

    def abort_request(self, request_id: str) -> None:
        """Cancel a request; its slot is freed at the next step (unknown ids are ignored)."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or awaiting its abort update."""
        return bool(self.scheduler.running or self.scheduler.waiting or self._aborts)

    @property
    def num_running(self) -> int:
        """Requests holding a cache slot."""
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return self.scheduler.num_waiting

    @property
    def kv_cache_bytes_used(self) -> int:
        """Bytes of the cache holding committed positions."""
        return self.scheduler.committed_tokens() * self.cache.bytes_per_token

    @property
    def kv_cache_bytes_total(self) -> int:
        """Bytes of the whole preallocated cache."""
        return self.cache.bytes_total

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestUpdate]:
        """One scheduling iteration; returns the updates it produced."""
        updates = self._apply_aborts()
        stats = StepStats()
        self.scheduler.admit(self.mask_token_id)
        participants: set[str] = set()

        by_length: dict[tuple[int, int], list[PrefillChunk]] = defaultdict(list)
        for chunk in self.scheduler.prefill_chunks():
            by_length[(chunk.length, chunk.request.block_size)].append(chunk)
        for chunks in by_length.values():
            self.runner.prefill(chunks)
            stats.forwards += 1
            for chunk in chunks:
                request = chunk.request
                participants.add(request.request_id)
                if request.committed >= request.prefill_target:
                    request.phase = Phase.DECODE
                    request.start_block(self.mask_token_id)

        # Rows of one forward share a width: B, or 2B when they also commit their last block.
        by_shape: dict[tuple[int, bool], list[Request]] = defaultdict(list)
        for request in self.scheduler.decoding():
            by_shape[(request.block_size, request.pending_commit is not None)].append(request)
        for group in by_shape.values():
            outcome = self.runner.decode(group)
            stats.forwards += 1
            stats.tokens_unmasked += outcome.tokens_unmasked
            participants.update(r.request_id for r in group)
            for request in outcome.denoised:
                update = self._after_denoise(request)
                if update is not None:
                    updates.append(update)

        stats.batch_size = len(participants)
        self.last_step = stats
        return updates

    def _after_denoise(self, request: Request) -> RequestUpdate | None:
        """Finish detection and block emission after a request's denoising step."""
        block_done = not bool(request.block_masked.any())
        known = request.generated + request.block_generated()
        finish = detect_finish(
            known,
            max_tokens=request.params.max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop=request.params.stop_strings(),
            decode=self.tokenizer.decode,
        )
        if finish is None and not block_done:
            return None
        if request.first_block_at is None:
            request.first_block_at = time.perf_counter()
        request.steps_per_block.append(request.step_in_block)
        if finish is None:
            new = known[len(request.generated) :]
            request.generated = known
            request.finish_block(self.mask_token_id)
            return self._update(request, new, finished=False, reason=None)
        final = known[: finish.num_tokens]
        new = final[len(request.generated) :]
        request.generated = final
        self.scheduler.remove(request.request_id)
        return self._update(request, new, finished=True, reason=finish.reason, cut=finish.text_end)

    def _update(
        self,
        request: Request,
        new_tokens: list[int],
        *,
        finished: bool,
        reason: str | None,
        cut: int | None = None,
    ) -> RequestUpdate:
        text = self.tokenizer.decode(request.generated)
        if cut is not None:
            text = text[:cut]
        stops = request.params.stop_strings()
        visible = releasable_text(text, finished=finished, stop=stops)
        delta = visible[len(request.emitted_text) :]
        request.emitted_text = visible
        return RequestUpdate(
            request_id=request.request_id,
            new_token_ids=new_tokens,
            text_delta=delta,
            finished=finished,
            finish_reason=reason,
            stats=self._stats(request) if finished else None,
        )

    def _stats(self, request: Request) -> RequestStats:
        now = time.perf_counter()
        completion = len(request.generated)
        first = request.first_block_at if request.first_block_at is not None else now
        return RequestStats(
            prompt_tokens=request.prompt_len,
            completion_tokens=completion,
            forwards=request.forwards,
            steps_per_block=list(request.steps_per_block),
            tokens_per_forward=completion / request.forwards if request.forwards else 0.0,
            time_to_first_block_s=first - request.arrival,
            e2e_s=now - request.arrival,
        )

    def _apply_aborts(self) -> list[RequestUpdate]:
        updates = []
        for request_id in self._aborts:
            request = self.scheduler.remove(request_id)
            if request is not None:
                updates.append(self._update(request, [], finished=True, reason="abort"))
        self._aborts.clear()
        return updates
