"""Per-host rate limits: token buckets for heartbeats (by host id) and registrations (by host
name), checked before any database write.

An agent heartbeats once per interval, and sooner only to report an instance's state change
(0.2 s after it, however many change at once: `agent.main_loop`). So a bucket refilled with
`per_interval` heartbeats per interval (4 by default: four times what an agent sends) and
holding `HEARTBEAT_BURST` of them lets every real agent through, transitions of a whole host
included, while a host that sends faster for longer (a runaway loop, a stolen agent token) is
answered 429 with Retry-After before its heartbeats reach the writer.

The interval is the host's own (the one its replies carry) when known, else the configured
one: a host registered under a shorter interval keeps beating at that one.

Per process, like the writer it protects: with several replicas a host may send each of them
this much, which is still bounded.

Registration (`RegistrationRateLimit`) revokes and mints tokens and re-plans the fleet, and a
real agent does it rarely: once at start, and again only after its token is refused. So a host
name may register `REGISTER_BURST` times back to back, then once per `REGISTER_REFILL_S`; a
caller registering one name in a loop (a stolen agent or bootstrap token) gets 429 with
Retry-After before anything is written.
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
# Registrations a host name may make back to back, then one per REGISTER_REFILL_S seconds.
REGISTER_BURST = 5
REGISTER_REFILL_S = 10.0


class HeartbeatTooSoon(Exception):
    """The host heartbeats faster than its limit; `retry_after_s` says when the next may come."""

    def __init__(self, host_id: int, per_second: float, retry_after_s: int) -> None:
        super().__init__(
            f"host {host_id} heartbeats faster than {per_second:.2f}/s (bursts of "
            f"{HEARTBEAT_BURST}): retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class RegisterTooSoon(Exception):
    """The host name registers faster than its limit; `retry_after_s` says when it may again."""

    def __init__(self, name: str, retry_after_s: int) -> None:
        super().__init__(
            f"host {name!r} registers too often ({REGISTER_BURST} back to back, then one per "
            f"{REGISTER_REFILL_S:g} s): retry after {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    tokens: float
    at: datetime
    interval_s: float


def _spend(bucket: _Bucket, now: datetime, per_second: float, burst: int) -> int | None:
    """Refill `bucket` up to `now` and spend one token: None, or (spending none) the whole
    seconds until one is there."""
    elapsed = max(0.0, (now - bucket.at).total_seconds())
    bucket.tokens = min(float(burst), bucket.tokens + elapsed * per_second)
    bucket.at = now
    if bucket.tokens < 1.0:
        return max(1, math.ceil((1.0 - bucket.tokens) / per_second))
    bucket.tokens -= 1.0
    return None


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
            wait = _spend(bucket, now, rate, self._burst)
            if wait is not None:
                raise HeartbeatTooSoon(host_id, rate, wait)

    def learn_interval(self, host_id: int, interval_s: float) -> None:
        """The host's own heartbeat interval (from its last reply)."""
        bucket = self._buckets.get(host_id)
        if bucket is not None and bucket.interval_s != interval_s:
            bucket.interval_s = interval_s

    def forget(self, host_id: int) -> None:
        """Drop a host's bucket (removed or registered again)."""
        with self._lock:
            self._buckets.pop(host_id, None)


class RegistrationRateLimit:
    """Token buckets by host name; `admit` is called once per registration, before its writes."""

    def __init__(
        self,
        burst: int = REGISTER_BURST,
        refill_s: float = REGISTER_REFILL_S,
        max_names: int = MAX_TRACKED_HOSTS,
    ) -> None:
        self._burst = burst
        self._per_second = 1.0 / refill_s
        self._max_names = max_names
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._buckets)

    def admit(self, name: str, now: datetime) -> None:
        """Spend one registration of the name's bucket, or raise `RegisterTooSoon` (spends none)."""
        with self._lock:
            bucket = self._buckets.get(name)
            if bucket is None:
                bucket = self._buckets[name] = _Bucket(self._burst, now, 0.0)
                while len(self._buckets) > self._max_names:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(name)
            wait = _spend(bucket, now, self._per_second, self._burst)
            if wait is not None:
                raise RegisterTooSoon(name, wait)

    def refund(self, name: str) -> None:
        """Give back the registration `admit` spent: it was refused and wrote nothing, so
        another caller naming this host cannot use up the real agent's registrations."""
        with self._lock:
            bucket = self._buckets.get(name)
            if bucket is not None:
                bucket.tokens = min(float(self._burst), bucket.tokens + 1.0)
