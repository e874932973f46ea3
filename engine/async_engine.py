"""Runs the synchronous EngineCore in one background thread and serves it to asyncio handlers.

The engine thread owns the core: it alone calls `add_request`, `abort_request` and `step`.
Handlers talk to it through a command queue and get their updates back on a per-request
`asyncio.Queue`, filled with `loop.call_soon_threadsafe`. Admission is bounded (running slots
plus `max_queue` waiting); beyond that `submit` raises `QueueFull` at once, so the server can
answer 429 instead of letting latency grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.errors import EngineStopped, QueueFull, RequestAbandoned
from engine.metrics import EngineMetrics

log = logging.getLogger("engine.async")

# How often (at most) the expert routing counts are copied out of the model for /metrics.
EXPERT_SNAPSHOT_INTERVAL_S = 1.0
# How often a waiting handler checks its deadline and whether its client is still connected.
POLL_S = 0.25


class CoreUpdate(Protocol):
    """What the server reads of an EngineCore `RequestUpdate`."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    stats: Any


class Core(Protocol):
    """The part of `engine.core.EngineCore` this module drives (a seam for tests)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def step(self) -> Sequence[CoreUpdate]: ...
    def has_unfinished(self) -> bool: ...

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


@dataclass
class RequestFailed:
    """Delivered on a request's queue when the engine could not run it."""

    error: Exception


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Any]


class AsyncEngine:
    """Thread-backed asynchronous front of an EngineCore."""

    def __init__(
        self,
        core: Core,
        metrics: EngineMetrics,
        *,
        max_running: int,
        max_queue: int,
        model: Any = None,
    ) -> None:
        self._core = core
        self._metrics = metrics
        self._model = model  # for expert routing counts; None when not tracked
        self._capacity = max_running + max_queue
        self._commands: queue.SimpleQueue[tuple[str, str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # guards _requests (touched by both threads)
        self._stopping = threading.Event()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._last_expert_snapshot = 0.0

    # ---- asyncio side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread."""
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Requests admitted and not yet finished."""
        with self._lock:
            return len(self._requests)

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (draining)."""
        self._accepting = False

    def submit(self, request_id: str, prompt_ids: list[int], params: Any) -> asyncio.Queue[Any]:
        """Admit a request; its updates (and a `RequestFailed`, if any) arrive on the queue."""
        if not self._accepting or self._stopping.is_set():
            raise EngineStopped("the server is shutting down and takes no new requests")
        pending = _Pending(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if len(self._requests) >= self._capacity:
                raise QueueFull(f"{len(self._requests)} requests in flight; the queue is full")
            self._requests[request_id] = pending
        self._commands.put(("add", request_id, (prompt_ids, params)))
        self._wake.set()
        return pending.updates

    def abort(self, request_id: str) -> None:
        """Cancel a request (client gone or timed out); its slot is freed at the next step."""
        with self._lock:
            known = self._requests.pop(request_id, None) is not None
        if known:
            self._commands.put(("abort", request_id, None))
            self._wake.set()

    async def updates(
        self,
        request_id: str,
        updates: asyncio.Queue[Any],
        *,
        deadline: float | None = None,
        client_gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[CoreUpdate]:
        """Yield a submitted request's updates until the finishing one.

        Raises TimeoutError past `deadline` (monotonic seconds) and `RequestAbandoned` when
        `client_gone()` turns true; in both cases, and when the consumer stops iterating early,
        the request is aborted so its slot is freed.
        """
        finished = False
        next_check = time.monotonic() + POLL_S
        try:
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError
                # uvicorn drops writes to a closed connection silently, so a steady stream of
                # updates would never notice a departed client: ask every POLL_S seconds.
                if client_gone is not None and now >= next_check:
                    next_check = now + POLL_S
                    if await client_gone():
                        raise RequestAbandoned(request_id)
                if updates.empty():
                    wait = POLL_S if deadline is None else min(POLL_S, deadline - now)
                    try:
                        item = await asyncio.wait_for(updates.get(), wait)
                    except TimeoutError:
                        continue
                else:
                    item = updates.get_nowait()  # no timer task when an update is waiting
                if isinstance(item, RequestFailed):
                    finished = True
                    raise item.error
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def drain(self, grace_s: float) -> int:
        """Stop admitting, wait up to `grace_s` for in-flight requests, abort the rest.

        Returns how many requests had to be aborted.
        """
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with self._lock:
            left = list(self._requests)
        for request_id in left:
            self._deliver(request_id, RequestFailed(EngineStopped("aborted by shutdown")))
            self.abort(request_id)
        return len(left)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            # Clear before reading commands: a submit that lands after this point sets the
            # event again, so the wait below can never sleep through it.
            self._wake.clear()
            self._apply_commands()
            if not self._core.has_unfinished():
                self._publish_gauges()
                self._wake.wait(0.5)
                continue
            try:
                updates = self._core.step()
            except Exception as exc:  # a bug or device failure: fail what is in flight, go on
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for update in updates:
                self._dispatch(update)
            self._publish_step()

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, request_id, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self._core.abort_request(request_id)
                continue
            with self._lock:
                wanted = request_id in self._requests
            if not wanted:
                continue  # aborted before it reached the core
            prompt_ids, params = payload
            try:
                self._core.add_request(request_id, prompt_ids, params)
            except Exception as exc:
                # Handlers validate first; this is the core disagreeing — report, don't crash.
                self._deliver(request_id, RequestFailed(exc), forget=True)

    def _dispatch(self, update: CoreUpdate) -> None:
        if update.finished:
            self._record_finished(update)
        self._deliver(update.request_id, update, forget=update.finished)

    def _deliver(self, request_id: str, item: Any, *, forget: bool = False) -> None:
        with self._lock:
            pending = self._requests.get(request_id)
            if forget:
                self._requests.pop(request_id, None)
        if pending is None:
            return  # aborted meanwhile; nobody listens
        # RuntimeError: the event loop is closed, the process is exiting.
        with contextlib.suppress(RuntimeError):
            pending.loop.call_soon_threadsafe(pending.updates.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        with self._lock:
            ids = list(self._requests)
        for request_id in ids:
            self._core.abort_request(request_id)
            self._deliver(request_id, RequestFailed(exc), forget=True)
            self._metrics.record_error("engine_error")

    def _record_finished(self, update: CoreUpdate) -> None:
        m = self._metrics
        m.requests_finished.labels(finish_reason=update.finish_reason or "abort").inc()
        stats = update.stats
        if stats is None:
            return
        m.prompt_tokens.inc(stats.prompt_tokens)
        m.generated_tokens.inc(stats.completion_tokens)
        if update.finish_reason == "abort":
            return  # latency of a cancelled request says nothing about the service
        m.e2e_latency.observe(stats.e2e_s)
        m.queue_wait.observe(stats.queue_s)
        if stats.completion_tokens:
            m.ttft.observe(stats.time_to_first_block_s)
        for steps in stats.steps_per_block:
            m.steps_per_block.observe(steps)
        if stats.forwards:
            m.tokens_per_forward.observe(stats.tokens_per_forward)

    def _publish_step(self) -> None:
        last = getattr(self._core, "last_step", None)
        batch = int(getattr(last, "batch_size", 0) or 0)
        if batch:
            self._metrics.batch_size.observe(batch)
        for block_size, seconds in getattr(last, "denoise_s", ()):
            self._metrics.denoise_step.labels(block_size=str(block_size)).observe(seconds)
        self._publish_gauges()
        now = time.monotonic()
        if self._model is not None and now - self._last_expert_snapshot >= (
            EXPERT_SNAPSHOT_INTERVAL_S
        ):
            self._last_expert_snapshot = now
            self._snapshot_experts()

    def _snapshot_experts(self) -> None:
        counts = getattr(self._model, "expert_token_counts", None)
        if counts is not None:
            self._metrics.expert_tokens.update(counts().tolist())

    def _publish_gauges(self) -> None:
        m, core = self._metrics, self._core
        m.requests_running.set(core.num_running)
        m.requests_waiting.set(core.num_waiting)
        used = getattr(core, "kv_cache_bytes_used", None)
        total = getattr(core, "kv_cache_bytes_total", None)
        if used is not None:
            m.kv_cache_used.set(used)
        if total is not None:
            m.kv_cache_total.set(total)
        if self._model is not None and not self._core.has_unfinished():
            self._snapshot_experts()  # idle: publish the final counts of the last batch
