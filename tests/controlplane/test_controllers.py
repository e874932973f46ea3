"""Controllers: the lease (one holder at a time, renewal, takeover, release), the loop that runs
them while holding it, and the host-health controller. Driven by a fake clock, no sleeps."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy.engine import Engine

from controlplane.controllers.host_health import HostHealthController
from controlplane.controllers.lease import DatabaseLease, new_holder_id
from controlplane.controllers.loop import ControllerLoop
from controlplane.db import make_engine
from tests.clock import FakeClock

PERIOD = timedelta(seconds=5)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


def lease(engine: Engine, holder: str) -> DatabaseLease:
    return DatabaseLease(engine, "controllers", holder, PERIOD)


def test_one_replica_holds_the_lease_until_it_stops_renewing(engine: Engine) -> None:
    clock = FakeClock()
    t0 = clock()
    a, b = lease(engine, "a"), lease(engine, "b")
    assert a.hold(clock()) and not b.hold(clock())
    stored = a.current()
    assert stored is not None and (stored.holder, stored.expires_at) == ("a", t0 + PERIOD)
    clock.advance(2)  # more than half the period left: no write
    assert a.hold(clock()) and a.current() == stored
    clock.advance(1)  # less than half left: renewed for a full period, same term
    assert a.hold(clock())
    renewed = a.current()
    assert renewed is not None
    assert (renewed.acquired_at, renewed.expires_at) == (t0, clock() + PERIOD)
    # a stops renewing (killed): b cannot take it until the hold has run out, then does.
    clock.advance(4.9)
    assert not b.hold(clock())
    clock.advance(0.1)
    assert b.hold(clock())
    taken = b.current()
    assert taken is not None and (taken.holder, taken.acquired_at) == ("b", clock())
    # a comes back (it was only paused): it knows it no longer holds the lease.
    assert not a.held(clock()) and not a.hold(clock())
    assert b.hold(clock())


def test_a_released_lease_is_taken_at_once(engine: Engine) -> None:
    clock = FakeClock()
    a, b = lease(engine, "a"), lease(engine, "b")
    assert a.hold(clock()) and not b.hold(clock())
    a.release(clock())
    assert not a.held(clock())
    assert b.hold(clock())
    a.release(clock())  # not held: changes nothing
    assert not a.hold(clock())


def test_holder_ids_differ_between_processes_and_fit_the_column() -> None:
    first, second = new_holder_id(), new_holder_id()
    assert first != second and len(first) <= 128 and first.count(":") >= 2


class Recorder:
    """A controller that records its ticks, optionally failing or taking time."""

    def __init__(self, name: str, fail: bool = False, clock: FakeClock | None = None) -> None:
        self.name = name
        self.ticks: list[datetime] = []
        self.fail = fail
        self.clock = clock

    def tick(self, now: datetime) -> None:
        self.ticks.append(now)
        if self.clock is not None:
            self.clock.advance(10)  # a slow round: the lease runs out meanwhile
        if self.fail:
            raise RuntimeError("boom")


def test_only_the_lease_holder_ticks_and_a_failing_controller_spares_the_rest(
    engine: Engine,
) -> None:
    clock = FakeClock()
    first = [Recorder("broken", fail=True), Recorder("fine")]
    second = [Recorder("fine")]
    leader = ControllerLoop(lease(engine, "a"), first, clock)
    standby = ControllerLoop(lease(engine, "b"), second, clock)
    for _ in range(3):
        assert leader.step() and not standby.step()
        clock.advance(1)
    assert [len(c.ticks) for c in first] == [3, 3] and second[0].ticks == []
    assert leader.leading and not standby.leading
    assert leader.interval_s == 1.0
    # The leader dies (no more rounds): the standby takes over once the hold runs out.
    clock.advance(5)
    assert standby.step() and standby.leading and len(second[0].ticks) == 1
    assert not leader.step()


def test_a_round_stops_when_the_lease_ran_out_during_it(engine: Engine) -> None:
    clock = FakeClock()
    slow, after = Recorder("slow", clock=clock), Recorder("after")
    loop = ControllerLoop(lease(engine, "a"), [slow, after], clock)
    assert loop.step()
    assert len(slow.ticks) == 1 and after.ticks == []  # another replica may lead by now


class CountingMonitor:
    """Stands in for HostHealthMonitor: records when it sweeps and prunes."""

    def __init__(self) -> None:
        self.sweeps: list[datetime | None] = []
        self.prunes: list[datetime | None] = []

    def sweep(self, now: datetime | None = None) -> list[object]:
        self.sweeps.append(now)
        return []

    def prune_samples(self, now: datetime | None = None) -> int:
        self.prunes.append(now)
        return 0


def test_host_health_sweeps_every_tick_and_prunes_samples_once_a_minute() -> None:
    clock = FakeClock()
    t0 = clock()
    monitor = CountingMonitor()
    controller = HostHealthController(monitor)  # type: ignore[arg-type]
    for _ in range(150):
        controller.tick(clock())
        clock.advance(1)
    assert len(monitor.sweeps) == 150 and monitor.sweeps[-1] == t0 + timedelta(seconds=149)
    assert monitor.prunes == [t0 + timedelta(seconds=s) for s in (0, 60, 120)]
