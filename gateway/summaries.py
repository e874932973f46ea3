"""What the traffic reports say about single requests and client tokens (`protocol.logs`).

    routed request  -> `served`:  its summary (sampled) and its token's usage count
    refused request -> `refused`: a count per (token, key id, reason)
    every report    -> `take` ... `merge_back` when the report could not be posted

Summaries are sampled: up to `sample_rps` x the seconds since the last report, every one goes;
above that, a uniform sample of that many (reservoir sampling over the interval, fair however
the requests were spread in it). Answers >= 500 always go, up to the report's limit: they are
the ones someone will look for. A report carries at most MAX_REQUESTS_PER_REPORT. Token usage
is never sampled: it is what the access audit counts.

A report that failed is merged back: its summaries compete with the new ones for the next
report's room (errors first) and its counts are added to the new ones, so an outage of the
control plane costs old summaries, never memory. Counts have bounds too (the report's limits):
a refusal past them is counted under its reason alone (token and key id ''), a usage past them
is dropped and counted in `dropped`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import Refusal
from protocol.logs import (
    MAX_REQUESTS_PER_REPORT,
    RequestSummary,
    TokenRefusal,
    TokenUsage,
)

MAX_REFUSALS = 1024  # `TrafficReport.refusals`
MAX_USAGES = 4096  # `TrafficReport.usage`
_REASONS = 5  # RefusalReason's values: the room kept for refusals counted by reason alone

UsageKey = tuple[str, str]  # token name, deployment


@dataclass
class _Reservoir:
    """A uniform sample of at most `size` of the items offered (algorithm R)."""

    size: int
    rng: random.Random
    items: list[RequestSummary] = field(default_factory=list)
    offered: int = 0

    def offer(self, item: RequestSummary) -> None:
        self.offered += 1
        if len(self.items) < self.size:
            self.items.append(item)
        else:
            slot = self.rng.randrange(self.offered)
            if slot < self.size:
                self.items[slot] = item

    def sample(self, count: int) -> list[RequestSummary]:
        """COUNT of the items, uniformly (all of them when there are no more)."""
        if len(self.items) <= count:
            return self.items
        return self.rng.sample(self.items, max(count, 0))


@dataclass
class TakenRequests:
    """What one report carries of requests and tokens."""

    requests: list[RequestSummary]
    refusals: list[TokenRefusal]
    usage: list[TokenUsage]
    since: float  # on the clock: when the interval began

    def __bool__(self) -> bool:
        return bool(self.requests or self.refusals or self.usage)


class RequestsSeen:
    """Request summaries, token usage and token refusals since the last report. CLOCK is
    monotonic seconds; RNG draws the samples."""

    def __init__(
        self, sample_rps: float, clock: Callable[[], float], rng: random.Random | None = None
    ) -> None:
        self.sample_rps = sample_rps
        self._clock = clock
        self._rng = rng or random.Random()
        self._since = clock()
        self._ok = _Reservoir(MAX_REQUESTS_PER_REPORT, self._rng)
        self._errors = _Reservoir(MAX_REQUESTS_PER_REPORT, self._rng)
        self._refusals: dict[Refusal, int] = {}
        self._usage: dict[UsageKey, list[int]] = {}  # requests, errors, rate limited
        self.dropped = 0  # usage counts that found no room (more keys than a report carries)

    def served(self, summary: RequestSummary) -> None:
        """Count one request routed to a deployment for a client token, and offer its summary."""
        (self._errors if summary.status >= 500 else self._ok).offer(summary)
        status = summary.status
        key = (summary.token, summary.deployment)
        self._add_usage(key, 1, int(status >= 500), int(status == 429))

    def refused(self, refusal: Refusal, count: int = 1) -> None:
        """Count COUNT refusals of one token for one reason."""
        if refusal not in self._refusals and len(self._refusals) >= MAX_REFUSALS - _REASONS:
            refusal = Refusal("", "", refusal.reason)  # past the bound: by reason alone
        self._refusals[refusal] = self._refusals.get(refusal, 0) + count

    def take(self) -> TakenRequests:
        """What the report about to be posted carries; the next interval starts empty."""
        now = self._clock()
        errors = self._errors.sample(MAX_REQUESTS_PER_REPORT)
        room = min(
            MAX_REQUESTS_PER_REPORT - len(errors), _budget(self.sample_rps, now - self._since)
        )
        requests = sorted([*errors, *self._ok.sample(room)], key=lambda s: s.time)
        refusals = [
            TokenRefusal(token=r.token, key_id=r.key_id, reason=r.reason, count=n)
            for r, n in self._refusals.items()
        ]
        usage = [
            TokenUsage(token=t, deployment=d, requests=c[0], errors=c[1], rate_limited=c[2])
            for (t, d), c in self._usage.items()
        ]
        taken = TakenRequests(requests, refusals, usage, self._since)
        self._since = now
        self._ok = _Reservoir(MAX_REQUESTS_PER_REPORT, self._rng)
        self._errors = _Reservoir(MAX_REQUESTS_PER_REPORT, self._rng)
        self._refusals = {}
        self._usage = {}
        return taken

    def merge_back(self, taken: TakenRequests) -> None:
        """Put back what a report that failed carried, so that the next one carries it too."""
        self._since = min(self._since, taken.since)
        for summary in taken.requests:
            (self._errors if summary.status >= 500 else self._ok).offer(summary)
        for r in taken.refusals:
            self.refused(Refusal(r.token, r.key_id, r.reason), r.count)
        for u in taken.usage:
            self._add_usage((u.token, u.deployment), u.requests, u.errors, u.rate_limited)

    def _add_usage(self, key: UsageKey, requests: int, errors: int, rate_limited: int) -> None:
        counts = self._usage.get(key)
        if counts is None:
            if len(self._usage) >= MAX_USAGES:
                self.dropped += requests
                return
            counts = self._usage[key] = [0, 0, 0]
        counts[0] += requests
        counts[1] += errors
        counts[2] += rate_limited


def _budget(sample_rps: float, seconds: float) -> int:
    """How many summaries below 500 an interval of SECONDS keeps at SAMPLE_RPS."""
    return int(sample_rps * max(seconds, 0.0) + 0.5)
