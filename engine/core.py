"""EngineCore: the synchronous decoding loop — schedule, execute, update — owned by one thread.

Each `step()` is one scheduling iteration. The scheduler plans it (admit waiting requests into
free cache slots, a budget of prompt chunks, then one forward per block size that carries every
running request's current block: a denoising step, fused with the commit of the previous block
when that one just finished; rows of width 2B go in their own forward). The runner executes each
forward and returns plain per-request results; `update_from_output` is the one place that
applies them to the requests: cache positions, unmasked tokens, finish detection, emitted
blocks and text. Requests that finish leave at once and free their slot for the next iteration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from engine.decoding import detect_finish, releasable_text
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidParams
from engine.families.base import FamilyRunner
from engine.families.runners import build_runner
from engine.params import SamplingParams
from engine.runner import RequestResult
from engine.scheduler import Request, Scheduler
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
    queue_s: float = 0.0  # waiting for a batch slot, before any forward


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
    # (block size, seconds) of each denoising forward: their jitter is a hardware signal.
    denoise_s: list[tuple[int, float]] = field(default_factory=list)


class EngineCore:
    """Continuous-batching block-diffusion decoder over a preallocated per-slot KV cache."""

    def __init__(
        self, model: Any, tokenizer: Tokenizer, *, max_batch_size: int, max_seq_len: int
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 1:
            raise InvalidParams(
                "max_batch_size" if max_batch_size < 1 else "max_seq_len",
                f"max_batch_size and max_seq_len must be >= 1, got {max_batch_size}, {max_seq_len}",
            )
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        # The model's family supplies the forwards and the decoding rule; everything else here
        # is shared by every family.
        self.runner: FamilyRunner = build_runner(
            model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len
        )
        self.cache = self.runner.cache
        self.default_block_size = self.runner.block_size
        self.eos_token_ids = frozenset(model.config.eos_token_ids or tokenizer.eos_token_ids)
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
        self.runner.check_params(params)
        decode = self.tokenizer.decode
        if not params.skip_special_tokens:
            decode = partial(decode, skip_special_tokens=False)
        request = Request(
            request_id=request_id,
            prompt_ids=list(prompt_token_ids),
            params=params,
            block_size=params.resolved_block_size(self.default_block_size),
            detokenizer=IncrementalDetokenizer(decode),
            stop_token_ids=self.stop_token_ids(params),
            aligned_prefill=self.runner.aligned_prefill,
            whole_prompt_prefill=self.runner.whole_prompt_prefill,
        )
        self.runner.start(request)
        # The first block starts right after the full prompt blocks that prefill caches.
        request.open_block(request.prefill_target, self.runner.placeholder_token_id)
        self.scheduler.add(request)

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end this request: its stop_token_ids, and EOS unless ignore_eos."""
        own = frozenset(params.stop_token_ids or ())
        return own if params.ignore_eos else own | self.eos_token_ids

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
        """One scheduling iteration: schedule -> execute -> update; returns the updates."""
        updates = self._apply_aborts()
        plan = self.scheduler.schedule()
        stats = StepStats(batch_size=plan.num_requests)
        # Prefill results go in before the decode forwards read the cache lengths they set.
        for chunks in plan.prefills:
            updates += self.update_from_output(self.runner.prefill(chunks))
            stats.forwards += 1
        for group in plan.decodes:
            # `decode` reads its results back to the host (`tolist`), so the wall time covers
            # the device's work too, not just the kernel launches.
            started = time.perf_counter()
            results = self.runner.decode(group)
            stats.denoise_s.append((group[0].block_size, time.perf_counter() - started))
            stats.forwards += 1
            stats.tokens_unmasked += sum(len(r.unmasked) for r in results)
            updates += self.update_from_output(results)
        self.last_step = stats
        return updates

    def update_from_output(self, results: Sequence[RequestResult]) -> list[RequestUpdate]:
        """Apply one forward's results to its requests: the only place decoding state changes.

        Returns the updates they produced: a finished block, a finished request, or none.
        """
        updates = []
        for result in results:
            request = self.scheduler.running[result.request_id]
            request.forwards += 1
            request.committed += result.prefilled
            if result.committed_block:
                request.committed += request.block_size
                request.pending_commit = None
            if not result.denoised:
                continue
            request.step_in_block += 1
            if result.state is not None:
                request.state = result.state
            for offset, token in zip(result.unmasked, result.tokens, strict=True):
                request.block_tokens[offset] = token
                request.block_masked[offset] = False
            update = self._after_denoise(request)
            if update is not None:
                updates.append(update)
        return updates

    def _after_denoise(self, request: Request) -> RequestUpdate | None:
        """Finish detection and block emission after a request's denoising step."""
        block_done = not any(request.block_masked)
        new_known = request.block_generated()
        stops = request.params.stop_strings()
        finish = detect_finish(
            len(request.generated),
            new_known,
            max_tokens=request.params.max_tokens,
            eos_token_ids=request.stop_token_ids,
            find_stop=partial(
                request.detokenizer.find_stop, stop=stops, min_tokens=request.params.min_tokens
            )
            if stops
            else None,
        )
        if finish is None and not block_done:
            return None
        if request.first_block_at is None:
            request.first_block_at = time.perf_counter()
        request.steps_per_block.append(request.step_in_block)
        if finish is None:
            request.detokenizer.extend(new_known)
            # The block is final: it is committed by the next block's first step.
            request.pending_commit = request.block_tokens
            request.open_block(request.block_start, self.runner.placeholder_token_id)
            return self._update(request, new_known, finished=False)
        new = new_known[: finish.num_tokens - len(request.generated)]
        request.detokenizer.extend(new)
        self.scheduler.remove(request.request_id)
        return self._update(request, new, finished=True, reason=finish.reason, cut=finish.text_end)

    def _update(
        self,
        request: Request,
        new_tokens: list[int],
        *,
        finished: bool,
        reason: str | None = None,
        cut: int | None = None,
    ) -> RequestUpdate:
        """The update carrying `new_tokens` and the text that may be released with them;
        `cut` ends the text (where a stop string starts)."""
        # Only the text not sent yet is sliced: the cost does not grow with the output.
        text = request.detokenizer.text_from(request.emitted_chars)
        if cut is not None:
            text = text[: max(0, cut - request.emitted_chars)]
        delta = releasable_text(text, finished=finished, stop=request.params.stop_strings())
        request.emitted_chars += len(delta)
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
            queue_s=(request.admitted_at or now) - request.arrival,
        )

    def _apply_aborts(self) -> list[RequestUpdate]:
        updates = []
        for request_id in self._aborts:
            request = self.scheduler.remove(request_id)
            if request is not None:
                updates.append(self._update(request, [], finished=True, reason="abort"))
        self._aborts.clear()
        return updates
