"""Controllers and the one loop that runs them while this replica holds the controllers' lease.

A controller is an object with `tick(now)`: look at the store, write what should change, return.
Host health is one today; the rollout controller joins it. Several control-plane replicas may
share a database; exactly one of them (the holder of the `controllers` lease) ticks them:

    every `interval`:  lease.hold(now) ──no──> wait (standby; take over when the hold runs out)
                            │yes
                            v
                       tick each controller (one failing does not stop the others)

A replica that stops (shutdown) releases the lease, so another takes over at its next round; one
that dies stops renewing, and another takes over once the hold runs out: within one lease period
plus one round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import datetime
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from controlplane.controllers.lease import DatabaseLease

log = logging.getLogger("controlplane.controllers")

CONTROLLERS_LEASE = "controllers"
# Rounds are at least this often, so a standby notices an expired lease quickly.
MAX_ROUND_S = 1.0


class Controller(Protocol):
    """Something the leader runs periodically."""

    name: str

    def tick(self, now: datetime) -> None:
        """Do one round of work as of `now`; raising only skips this round."""


class ControllerLoop:
    """Runs `controllers` every round while `lease` is held; `step()` is one round."""

    def __init__(
        self,
        lease: DatabaseLease,
        controllers: Sequence[Controller],
        clock: Callable[[], datetime],
    ) -> None:
        self.lease = lease
        self.controllers = list(controllers)
        self._clock = clock
        self.interval_s = min(MAX_ROUND_S, lease.period.total_seconds() / 4)

    @property
    def leading(self) -> bool:
        """True while this replica holds the lease (and so runs the controllers)."""
        return self.lease.held(self._clock())

    def step(self) -> bool:
        """One round, synchronously: hold the lease, then tick; True when this replica leads."""
        if not self.lease.hold(self._clock()):
            return False
        self.tick()
        return True

    def tick(self) -> None:
        """Tick every controller once; stop early if the hold ran out meanwhile."""
        for controller in self.controllers:
            now = self._clock()
            if not self.lease.held(now):
                return  # another replica may lead by now: leave the work to it
            try:
                controller.tick(now)
            except Exception:  # one failed round must not stop the loop or the others
                log.exception("controller %s failed a round", controller.name)

    async def run(self, hold: Callable[[Callable[[], bool]], Awaitable[bool]]) -> None:
        """Round after round until cancelled; the lease is released on the way out.

        `hold` runs the lease write where the app's writes go (on SQLite: in turn with the
        heartbeat writer, not against it); the ticks run in the thread pool.
        """
        try:
            while True:
                try:
                    if await hold(lambda: self.lease.hold(self._clock())):
                        await run_in_threadpool(self.tick)
                except Exception:  # the next round retries
                    log.exception("controller round failed")
                await asyncio.sleep(self.interval_s)
        finally:
            await asyncio.shield(run_in_threadpool(self.lease.release, self._clock()))


class LeaderCollector(Collector):
    """`dctl_controller_leader{holder}`: 1 on the replica that runs the controllers, else 0."""

    def __init__(self, loop: ControllerLoop) -> None:
        self._loop = loop

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """This replica's view: does it hold the controllers' lease now."""
        gauge = GaugeMetricFamily(
            "dctl_controller_leader",
            "1 while this replica holds the controllers' lease and runs them",
            labels=["holder"],
        )
        gauge.add_metric([self._loop.lease.holder], 1.0 if self._loop.leading else 0.0)
        yield gauge
