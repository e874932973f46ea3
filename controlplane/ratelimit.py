"""Per-host heartbeat rate limit: a token bucket per host, checked before any database work.

An agent heartbeats once per interval, and sooner only to report an instance's state change
(0.2 s after it, however many change at once: `agent.runtime`). So a bucket refilled with
`per_interval` heartbeats per interval (4 by default: four times what an agent sends) and
holding `HEARTBEAT_BURST` of them lets every real agent through, transitions of a whole host
included, while a host that sends faster for longer (a runaway loop, a stolen agent token) is
answered 429 with Retry-After before its heartbeats reach the writer.

The interval is the host's own (the one its replies carry) when known, else the configured
one: a host registered under a shorter interval keeps beating at that one.

Per process, like the writer it protects: with several replicas a host may send each of them
this much, which is still bounded.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

# Heartbeats a host may send back to back: enough for prompt reports of every instance of a
# host changing state (and retries after an outage) without ever waiting for a refill.
HEARTBEAT_BURST = 60
# Hosts remembered at most (least recently heartbeating first out); a forgotten host starts
# again with a full bucket, so the bound costs a flood at most one extra burst.
MAX_TRACKED_HOSTS = 20_000


class HeartbeatTooSoon(Exception):
    """The host heartbeats faster than its limit; `retry_after_s` says when the next may come."""

    def __init__(self, host_id: int, per_second: float, retry_after_s: int) -> None:
        super().__init__(
            f"host {host_id} heartbeats faster than {per_second:.2f}/s (bursts of "
            f"{HEARTBEAT_BURST}): retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    tokens: float
    at: datetime
    interval_s: float


class HeartbeatRateLimit:
    """Token buckets by host id; `admit` is called once per heartbeat, before its write."""

    def __init__(
        self,
        interval_s: float,
        per_interval: float,
        burst: int = HEARTBEAT_BURST,
        max_hosts: int = MAX_TRACKED_HOSTS,
    ) -> None:
        self._interval_s = interval_s
        self._per_interval = per_interval
        self._burst = burst
        self._max_hosts = max_hosts
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def admit(self, host_id: int, now: datetime) -> None:
        """Spend one heartbeat of the host's bucket, or raise `HeartbeatTooSoon` (spends none)."""
        with self._lock:
            bucket = self._buckets.get(host_id)
            if bucket is None:
                bucket = self._buckets[host_id] = _Bucket(self._burst, now, self._interval_s)
                while len(self._buckets) > self._max_hosts:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(host_id)
            rate = self._per_interval / min(bucket.interval_s, self._interval_s)
            elapsed = max(0.0, (now - bucket.at).total_seconds())
            bucket.tokens = min(float(self._burst), bucket.tokens + elapsed * rate)
            bucket.at = now
            if bucket.tokens < 1.0:
                wait = math.ceil((1.0 - bucket.tokens) / rate)
                raise HeartbeatTooSoon(host_id, rate, max(1, wait))
            bucket.tokens -= 1.0

    def learn_interval(self, host_id: int, interval_s: float) -> None:
        """The host's own heartbeat interval (from its last reply)."""
        bucket = self._buckets.get(host_id)
        if bucket is not None and bucket.interval_s != interval_s:
            bucket.interval_s = interval_s

    def forget(self, host_id: int) -> None:
        """Drop a host's bucket (removed or registered again)."""
        with self._lock:
            self._buckets.pop(host_id, None)
