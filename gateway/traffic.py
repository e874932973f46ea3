"""What the gateway served, per (deployment, version, pool), reported to the control plane.

`TrafficWindows` adds up finished requests into `TrafficCounts`-shaped windows (counts and
latency / TTFT histogram buckets over `LATENCY_BUCKETS_S`, which add up by position across
windows and gateways). `TrafficReporter` swaps the windows out every few seconds and posts them;
when the post fails for a reason that may pass (control plane down, overloaded, token being
fixed) it merges them back, so nothing is lost, and memory stays bounded by the number of
(deployment, version, pool) keys (at most `MAX_WINDOWS`), not by the length of the outage.

Output tokens come from the engines' own usage reports, read as answers stream past
(`gateway.usage.UsageReader`): the gateway never parses an answer whole.

A report also carries what `gateway.summaries.RequestsSeen` kept of single requests and client
tokens (request summaries, token usage, token refusals), merged back with the windows when the
post fails.
"""

from __future__ import annotations

import asyncio
import logging
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol

from gateway.pool_share import PoolShares
from gateway.summaries import RequestsSeen, TakenRequests
from protocol.gateway import (
    LATENCY_BUCKETS_S,
    Pool,
    Tally,
    TrafficAccepted,
    TrafficReport,
    TrafficWindow,
)

log = logging.getLogger("dctl.gateway.traffic")

WindowKey = tuple[str, int, Pool]  # deployment, version id (the routing table's), pool
# How a request that reached a pool ended, as the windows count it (None: an answer, 2xx/3xx).
ErrorClass = Literal["5xx", "timeout", "connect", "client_4xx"]
MAX_WINDOWS = 4096  # a report's limit (`TrafficReport.windows`)
# Report failures worth keeping the windows for: no answer, the control plane failing or busy,
# or a token an operator can still fix. Anything else would be refused again.
_RETRYABLE_STATUSES = {401, 403, 408, 429}


def bucket_index(seconds: float) -> int:
    """The bucket SECONDS falls in: the first bound >= it, or the last (+Inf) bucket."""
    return bisect_left(LATENCY_BUCKETS_S, seconds)


# One window's counts while they accumulate.
Counts = Tally


@dataclass
class TakenWindows:
    """Windows swapped out for a report."""

    started_at: datetime
    ended_at: datetime
    counts: dict[WindowKey, Counts]

    def windows(self) -> list[TrafficWindow]:
        """The windows in the report's shape."""
        return [
            TrafficWindow(deployment=d, version_id=v, pool=p, **vars(c))
            for (d, v, p), c in sorted(self.counts.items())
        ]


class TrafficWindows:
    """The windows being filled; NOW is the wall clock (reports carry real times). SHARES, when
    given, counts every recorded request too (`dctl_gateway_pool_share`)."""

    def __init__(self, now: Callable[[], datetime], shares: PoolShares | None = None) -> None:
        self._now = now
        self.shares = shares
        self.started_at = now()
        self._counts: dict[WindowKey, Counts] = {}
        self.dropped = 0  # requests not counted: more keys than a report can carry

    def record(
        self,
        key: WindowKey,
        error: ErrorClass | None,
        latency_s: float,
        ttft_s: float | None,
        output_tokens: int,
    ) -> None:
        """Count one finished request. TTFT_S: None when no body byte came back."""
        if self.shares is not None:
            self.shares.count(key[0], key[-1])  # deployment, pool
        counts = self._counts.get(key)
        if counts is None:
            if len(self._counts) >= MAX_WINDOWS:
                self.dropped += 1
                return
            counts = self._counts[key] = Counts()
        counts.requests += 1
        if error == "5xx":
            counts.errors_5xx += 1
        elif error == "timeout":
            counts.errors_timeout += 1
        elif error == "connect":
            counts.errors_connect += 1
        elif error == "client_4xx":
            counts.client_4xx += 1
        counts.output_tokens += output_tokens
        counts.latency_buckets[bucket_index(latency_s)] += 1
        counts.latency_sum_s += latency_s
        if ttft_s is not None:
            counts.ttft_buckets[bucket_index(ttft_s)] += 1
            counts.ttft_sum_s += ttft_s

    def peek(self, key: WindowKey) -> Counts | None:
        """The counts of KEY so far (not swapped out)."""
        return self._counts.get(key)

    def take(self) -> TakenWindows:
        """Swap the windows out (for a report) and start new ones."""
        now = self._now()
        taken = TakenWindows(self.started_at, now, self._counts)
        self._counts = {}
        self.started_at = now
        return taken

    def merge_back(self, taken: TakenWindows) -> None:
        """Put windows whose report failed back, so the next report carries them too."""
        self.started_at = min(self.started_at, taken.started_at)
        for key, counts in taken.counts.items():
            mine = self._counts.get(key)
            if mine is not None:
                mine.add(counts)
            elif len(self._counts) < MAX_WINDOWS:
                self._counts[key] = counts
            else:
                self.dropped += counts.requests


class TrafficSink(Protocol):
    """Where reports go: `client.http.AsyncControlPlaneClient` implements it."""

    async def report_traffic(self, report: TrafficReport) -> TrafficAccepted:
        """Post one report."""
        ...


class TrafficReporter:
    """Posts the windows to SINK every INTERVAL_S as gateway GATEWAY_ID at ADDRESS:PORT."""

    def __init__(
        self,
        windows: TrafficWindows,
        sink: TrafficSink,
        *,
        gateway_id: str,
        address: str | None,
        port: int | None,
        interval_s: float,
        seen: RequestsSeen | None = None,
    ) -> None:
        self.windows = windows
        self.seen = seen
        self.sink = sink
        self.gateway_id = gateway_id
        self.address = address
        self.port = port
        self.interval_s = interval_s
        self.failing = False

    async def report_once(self) -> bool:
        """Post what was served since the last report; True when the control plane took it
        (or there was nothing to post)."""
        taken = self.windows.take()
        requests = self.seen.take() if self.seen is not None else None
        if not taken.counts and not requests:
            return True
        report = TrafficReport(
            gateway=self.gateway_id,
            address=self.address,
            port=self.port,
            started_at=taken.started_at,
            ended_at=taken.ended_at,
            windows=taken.windows(),
            requests=requests.requests if requests else [],
            refusals=requests.refusals if requests else [],
            usage=requests.usage if requests else [],
        )
        try:
            accepted = await self.sink.report_traffic(report)
        except Exception as exc:  # ClientError, or anything else: the reporter must live on
            status = getattr(exc, "status", None)
            if status is None or status >= 500 or status in _RETRYABLE_STATUSES:
                self._merge_back(taken, requests)
                if not self.failing:
                    log.warning("cannot report traffic (kept for the next report): %s", exc)
                self.failing = True
            else:
                log.error(
                    "traffic report refused, %d windows and %d request summaries dropped: %s",
                    len(report.windows), len(report.requests), exc,
                )  # fmt: skip
            return False
        if self.failing:
            log.info("traffic reports accepted again")
            self.failing = False
        if accepted.skipped:
            log.info(
                "traffic windows skipped by the control plane: %s", ", ".join(accepted.skipped)
            )
        return True

    def _merge_back(self, taken: TakenWindows, requests: TakenRequests | None) -> None:
        self.windows.merge_back(taken)
        if self.seen is not None and requests is not None:
            self.seen.merge_back(requests)

    async def run(self) -> None:
        """Report every INTERVAL_S until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.report_once()
