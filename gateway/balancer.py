"""Which instance serves a request: pool choice by canary weight, least outstanding requests
within the pool, and passive health (ejection of instances that keep failing).

Pure policy with the clock and the random source injected; the proxy reports what happened
(`started`, `finished`, `succeeded`, `failed`) and asks for the next instance (`pick`).

Passive health of one instance, keyed by instance id so it survives routing-table swaps:

    healthy --3 consecutive failures--> ejected (10 s) --time passes--> probation
    probation --1 failure--> ejected (twice as long as last time, at most 120 s)
    healthy | probation | ejected --a success--> healthy (counters reset)

When every instance a request may use is ejected, the one whose ejection ends first is tried
("panic" routing, as Envoy does below its panic threshold): a restarted engine is ejected for
its downtime and is usually back before its 10 s are over, so during a rolling restart of two
instances both can be ejected at once while one serves again; an attempt beats a certain 503.

A failure is a connection that could not be made or broke before an answer, or a 5xx answer.
Failures of requests that were already in flight when the instance was ejected change nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass

from gateway.routes import Instance, Route, VersionPool
from protocol.gateway import Pool

EJECT_AFTER_FAILURES = 3
EJECT_BASE_S = 10.0
EJECT_MAX_S = 120.0


@dataclass
class InstanceHealth:
    """What the gateway has seen of one instance."""

    outstanding: int = 0
    failures: int = 0  # consecutive, since the last success or ejection
    ejections: int = 0  # consecutive ejections without a success in between
    ejected_until: float = 0.0


class Balancer:
    """Chooses pools and instances; CLOCK is monotonic seconds, RNG the random source.

    ON_EJECT(instance, seconds) is called whenever an instance is ejected (metrics, logs).
    """

    def __init__(
        self,
        clock: Callable[[], float],
        rng: random.Random,
        on_eject: Callable[[Instance, float], None] | None = None,
    ) -> None:
        self._clock = clock
        self._rng = rng
        self._on_eject = on_eject
        self._health: dict[int, InstanceHealth] = {}

    def health(self, instance_id: int) -> InstanceHealth:
        """The state of one instance (created on first use)."""
        state = self._health.get(instance_id)
        if state is None:
            state = self._health[instance_id] = InstanceHealth()
        return state

    def pool_order(self, route: Route, pinned: Pool | None = None) -> tuple[VersionPool, ...]:
        """The pools to try, in order: the pinned one alone, or the weighted choice first and
        the other pool as the fallback."""
        if pinned is not None:
            pool = route.pool(pinned)
            return () if pool is None else (pool,)
        canary = route.canary
        if canary is None:
            return (route.stable,)
        if route.canary_weight > 0 and self._rng.random() * 100 < route.canary_weight:
            return (canary, route.stable)
        return (route.stable, canary)

    def pick(
        self, pools: tuple[VersionPool, ...], exclude: Collection[int] = ()
    ) -> tuple[VersionPool, Instance] | None:
        """The usable instance with the fewest outstanding requests in the first pool of POOLS
        that has one (ties broken at random); None when no pool has one."""
        now = self._clock()
        for pool in pools:
            best: Instance | None = None
            best_outstanding = 0
            ties = 0
            for instance in pool.instances:
                if instance.id in exclude:
                    continue
                state = self.health(instance.id)
                if state.ejected_until > now:
                    continue
                if best is None or state.outstanding < best_outstanding:
                    best, best_outstanding, ties = instance, state.outstanding, 1
                elif state.outstanding == best_outstanding:
                    ties += 1  # reservoir sampling: each tied instance ends up chosen with 1/ties
                    if self._rng.randrange(ties) == 0:
                        best = instance
            if best is not None:
                return pool, best
        return self._panic_pick(pools, exclude)

    def _panic_pick(
        self, pools: tuple[VersionPool, ...], exclude: Collection[int]
    ) -> tuple[VersionPool, Instance] | None:
        """Every instance is ejected: the one whose ejection ends first, in the first pool with
        any; None when the pools are empty."""
        for pool in pools:
            candidates = [i for i in pool.instances if i.id not in exclude]
            if candidates:
                return pool, min(candidates, key=lambda i: self.health(i.id).ejected_until)
        return None

    def started(self, instance: Instance) -> None:
        """A request was sent to INSTANCE."""
        self.health(instance.id).outstanding += 1

    def finished(self, instance: Instance) -> None:
        """A request to INSTANCE is over, however it ended."""
        self.health(instance.id).outstanding -= 1

    def succeeded(self, instance: Instance) -> None:
        """INSTANCE answered (anything but 5xx): it is healthy, ejected or not."""
        state = self.health(instance.id)
        state.failures = 0
        state.ejections = 0
        state.ejected_until = 0.0

    def failed(self, instance: Instance) -> bool:
        """INSTANCE failed a request; True when that ejected it."""
        state = self.health(instance.id)
        now = self._clock()
        if state.ejected_until > now:
            return False  # a request from before the ejection: already counted
        state.failures += 1
        if state.failures < EJECT_AFTER_FAILURES and state.ejections == 0:
            return False
        seconds = min(EJECT_BASE_S * 2 ** min(state.ejections, 16), EJECT_MAX_S)
        state.ejections += 1
        state.failures = 0
        state.ejected_until = now + seconds
        if self._on_eject is not None:
            self._on_eject(instance, seconds)
        return True

    def is_ejected(self, instance_id: int) -> bool:
        """Whether the instance is ejected right now."""
        state = self._health.get(instance_id)
        return state is not None and state.ejected_until > self._clock()

    def retain(self, instance_ids: Collection[int]) -> None:
        """Forget instances that left the routing table (unless requests to them are in flight)."""
        for instance_id in [i for i in self._health if i not in instance_ids]:
            if self._health[instance_id].outstanding <= 0:
                del self._health[instance_id]
