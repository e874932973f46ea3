"""AsyncEngine against a scripted core: admission bounds, cancellation, drain, failures.

The fake stands in for EngineCore through the `Core` protocol (the seam the server uses), so
these run in milliseconds and pin down the thread/asyncio hand-off exactly.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import EngineStopped, QueueFull
from engine.metrics import EngineMetrics


@dataclass
class Update:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    stats: Any = None


@dataclass
class FakeCore:
    """Each step gives every running request one token; a request wants `params` tokens."""

    max_running: int = 2
    step_s: float = 0.002
    fail_on_step: int | None = None
    steps: int = 0
    running: dict[str, list[int]] = field(default_factory=dict)
    waiting: list[tuple[str, int]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self.waiting.append((request_id, int(params)))

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.pop(request_id, None)
        self.waiting = [w for w in self.waiting if w[0] != request_id]

    def step(self) -> list[Update]:
        self.steps += 1
        if self.fail_on_step == self.steps:
            raise RuntimeError("device lost")
        while self.waiting and len(self.running) < self.max_running:
            rid, n = self.waiting.pop(0)
            self.running[rid] = [n, 0]
        time.sleep(self.step_s)
        updates = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            updates.append(Update(rid, [state[1]], str(state[1]), done, "length" if done else None))
            if done:
                del self.running[rid]
        return updates

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


@pytest.fixture
def core() -> FakeCore:
    return FakeCore()


@pytest.fixture
def engine(core: FakeCore) -> Any:
    eng = AsyncEngine(core, EngineMetrics(), max_running=2, max_queue=1)
    eng.start()
    yield eng
    eng.shutdown()


async def collect(engine: AsyncEngine, rid: str, tokens: int) -> str:
    updates = engine.submit(rid, [1], tokens)
    return "".join([u.text_delta async for u in engine.updates(rid, updates)])


async def test_updates_arrive_in_order_and_end_with_the_finishing_one(engine: AsyncEngine) -> None:
    texts = await asyncio.gather(*(collect(engine, f"r{i}", 3 + i) for i in range(3)))
    assert texts == ["123", "1234", "12345"]
    assert engine.in_flight == 0


async def test_admission_is_bounded_by_slots_plus_queue(engine: AsyncEngine) -> None:
    for i in range(3):
        engine.submit(f"r{i}", [1], 1000)
    with pytest.raises(QueueFull):
        engine.submit("r3", [1], 1)
    for i in range(3):
        engine.abort(f"r{i}")
    assert engine.in_flight == 0
    engine.submit("r4", [1], 1)  # room again


async def test_leaving_the_iteration_aborts_the_request_in_the_core(
    engine: AsyncEngine, core: FakeCore
) -> None:
    updates = engine.submit("long", [1], 10_000)
    async for _ in engine.updates("long", updates):
        break
    for _ in range(100):
        if "long" in core.aborted:
            break
        await asyncio.sleep(0.01)
    assert core.aborted == ["long"]
    assert engine.in_flight == 0


async def test_a_deadline_raises_timeout_and_aborts(engine: AsyncEngine, core: FakeCore) -> None:
    updates = engine.submit("slow", [1], 10_000)
    with pytest.raises(TimeoutError):
        async for _ in engine.updates("slow", updates, deadline=time.monotonic() + 0.1):
            pass
    await asyncio.sleep(0.05)
    assert "slow" in core.aborted


async def test_drain_lets_short_requests_finish_and_aborts_the_rest(
    engine: AsyncEngine, core: FakeCore
) -> None:
    short = asyncio.create_task(collect(engine, "short", 5))
    long_updates = engine.submit("long", [1], 100_000)
    await asyncio.sleep(0)
    aborted = await engine.drain(grace_s=0.5)
    assert await short == "12345"
    assert aborted == 1
    with pytest.raises(EngineStopped):
        async for _ in engine.updates("long", long_updates):
            pass
    with pytest.raises(EngineStopped):
        engine.submit("late", [1], 1)


async def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_goes_on(
    core: FakeCore,
) -> None:
    core.fail_on_step = 2
    engine = AsyncEngine(core, EngineMetrics(), max_running=2, max_queue=1)
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            await collect(engine, "doomed", 5)
        assert await collect(engine, "next", 2) == "12"
    finally:
        engine.shutdown()
