"""The split clients see: each pool's share of a deployment's requests over the last minute,
exported as `dctl_gateway_pool_share{deployment,pool}`.

The canary weight is what the routing table asks for, not what clients get: passive health
(`balancer.py`) sends the requests of an ejected instance to the other pool, so a canary that
keeps failing can serve 2% of the requests at weight 20. The gauge shows the split that really
happened, beside the weight, so a dashboard (and an operator) sees a starved canary.

Requests are counted as the traffic windows count them (every attempt at a pool, pinned requests
left out), so the gauge and the control plane's `served` share, computed from those windows,
tell the same story. Counts go into buckets of `BUCKET_S` seconds on the monotonic clock; a
scrape adds up those of the last `WINDOW_S`. A pool of the routing table that served nothing
while its deployment served something shows 0; a deployment without requests in the window shows
no share at all (0 of 0 is not a split).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily

from gateway.routes import Routes
from protocol.gateway import Pool

WINDOW_S = 60.0
BUCKET_S = 5.0
METRIC = "dctl_gateway_pool_share"
_HELP = (
    "The share (0..1) of a deployment's requests each pool served over the last minute (each "
    "attempt, pinned requests aside, as the traffic windows count them). Set it against the "
    "canary weight: passive health can starve a failing canary."
)

PoolKey = tuple[str, Pool]  # deployment, pool


class PoolShares:
    """Requests per (deployment, pool) over the last WINDOW_S; CLOCK is monotonic seconds."""

    def __init__(
        self, clock: Callable[[], float], window_s: float = WINDOW_S, bucket_s: float = BUCKET_S
    ) -> None:
        self._clock = clock
        self._bucket_s = bucket_s
        self._buckets_kept = max(1, round(window_s / bucket_s))
        self._buckets: deque[tuple[int, dict[PoolKey, int]]] = deque()

    def count(self, deployment: str, pool: Pool) -> None:
        """One request to POOL of DEPLOYMENT, now."""
        slot = int(self._clock() // self._bucket_s)
        if not self._buckets or self._buckets[-1][0] != slot:
            self._buckets.append((slot, {}))
            while self._buckets[0][0] <= slot - self._buckets_kept:
                self._buckets.popleft()
        counts = self._buckets[-1][1]
        key = (deployment, pool)
        counts[key] = counts.get(key, 0) + 1

    def requests(self) -> dict[PoolKey, int]:
        """The requests of each (deployment, pool) in the window ending now."""
        oldest = int(self._clock() // self._bucket_s) - self._buckets_kept
        totals: dict[PoolKey, int] = {}
        for slot, counts in self._buckets:
            if slot > oldest:
                for key, n in counts.items():
                    totals[key] = totals.get(key, 0) + n
        return totals

    def shares(self, pools: Iterable[PoolKey] = ()) -> dict[PoolKey, float]:
        """Each pool's share of its deployment's requests in the window; POOLS (those of the
        routing table) get a 0 when their deployment served requests and they none."""
        requests = self.requests()
        per_deployment: dict[str, int] = {}
        for (deployment, _pool), n in requests.items():
            per_deployment[deployment] = per_deployment.get(deployment, 0) + n
        keys = set(requests) | {k for k in pools if per_deployment.get(k[0])}
        return {k: requests.get(k, 0) / per_deployment[k[0]] for k in sorted(keys)}


class PoolShareCollector:
    """`dctl_gateway_pool_share`, computed at each scrape from SHARES and the pools of ROUTES."""

    def __init__(self, shares: PoolShares, routes: Routes) -> None:
        self._shares = shares
        self._routes = routes

    def describe(self) -> Iterable[GaugeMetricFamily]:
        """The family without samples (so registering it does not compute anything)."""
        return [GaugeMetricFamily(METRIC, _HELP, labels=["deployment", "pool"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The family with one sample per (deployment, pool)."""
        family = GaugeMetricFamily(METRIC, _HELP, labels=["deployment", "pool"])
        for (deployment, pool), share in self._shares.shares(self._routed_pools()).items():
            family.add_metric([deployment, pool], share)
        yield family

    def _routed_pools(self) -> list[PoolKey]:
        table = self._routes.current
        if table is None:
            return []
        return [
            (route.deployment, pool.name)
            for route in table.routes
            for pool in (route.stable, route.canary)
            if pool is not None
        ]
