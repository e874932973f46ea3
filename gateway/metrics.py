"""The gateway's own `/metrics` (Prometheus text, no auth, like the engine's), on a registry of
its own. Per-series children are looked up once per (deployment, version, pool, pinned) and
kept, so a request pays for increments, not for label lookups.

`pinned="true"` marks requests a token with the grant pinned to a pool (`x-dctl-pool`): a smoke
test stays visible here while the traffic windows, which the rollout analysis reads, leave it
out; a query that judges a version should select `pinned="false"`.

`dctl_gateway_pool_share` (the split clients saw, per pool) is computed at each scrape by
`gateway.pool_share.PoolShareCollector`, which `build_gateway` registers on this registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from protocol.gateway import LATENCY_BUCKETS_S

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = ["deployment", "version", "pool", "pinned"]


@dataclass
class Series:
    """The children of one (deployment, version, pool, pinned)."""

    labels: tuple[str, str, str, str]
    duration: Histogram
    ttft: Histogram
    output_tokens: Counter
    codes: dict[int, Counter]


class GatewayMetrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "dctl_gateway_requests",
            "Requests answered, by deployment, version, pool, pinned (x-dctl-pool) and status "
            "code (499: the client left first). Refusals before a deployment is known have "
            "empty labels.",
            [*_LABELS, "code"],
            registry=r,
        )
        self.duration = Histogram(
            "dctl_gateway_request_duration_seconds",
            "From receiving a request to its last response byte.",
            _LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "dctl_gateway_ttft_seconds",
            "From receiving a request to its first token: in a stream the first event with "
            "text (a chat stream's opening role-only chunk does not count), else the first "
            "response body byte.",
            _LABELS,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.output_tokens = Counter(
            "dctl_gateway_output_tokens",
            "Completion tokens, as the engines' usage reports them.",
            _LABELS,
            registry=r,
        )
        self.retries = Counter(
            "dctl_gateway_retries",
            "Requests sent to a second instance, by deployment and why "
            "(connect: no connection; broken: closed unanswered, or a 5xx that is no API "
            "answer; unavailable: a 503).",
            ["deployment", "reason"],
            registry=r,
        )
        self.ejections = Counter(
            "dctl_gateway_ejections",
            "Instances taken out of rotation by passive health checks.",
            ["deployment", "version", "instance_id"],
            registry=r,
        )
        self.inflight = Gauge(
            "dctl_gateway_inflight",
            "Completion requests being served (those held for a cold start included).",
            registry=r,
        )
        self.cold_start_waiting = Gauge(
            "dctl_gateway_cold_start_waiting",
            "Requests held for a deployment scaled to zero until an instance of it is ready.",
            ["deployment"],
            registry=r,
        )
        self.cold_start_wait = Histogram(
            "dctl_gateway_cold_start_wait_seconds",
            "How long requests were held for a deployment scaled to zero, by how the wait ended "
            "(served: an instance became ready; timeout: cold_start_timeout_s passed, answered "
            "503; gone: the deployment left the routing table; client_left).",
            ["deployment", "outcome"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.wake_calls = Counter(
            "dctl_gateway_wake_calls",
            "Calls asking the control plane to wake a deployment scaled to zero, by result "
            "(accepted; gone: the control plane does not know the deployment; failed: any other "
            "failure, retried).",
            ["deployment", "result"],
            registry=r,
        )
        self.request_log_lines = Counter(
            "dctl_gateway_request_log_lines",
            "Lines of the JSONL request log (request_log_file), by outcome: written, or dropped "
            "(the disk could not keep up, or failed).",
            ["outcome"],
            registry=r,
        )
        self._series: dict[tuple[str, str, str, str], Series] = {}
        self._refusals: dict[int, Counter] = {}

    def series(self, deployment: str, version: str, pool: str, pinned: bool = False) -> Series:
        """The children of one (deployment, version, pool, pinned)."""
        key = (deployment, version, pool, "true" if pinned else "false")
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = Series(
                key,
                self.duration.labels(*key),
                self.ttft.labels(*key),
                self.output_tokens.labels(*key),
                {},
            )
        return found

    def count(self, series: Series | None, code: int) -> None:
        """Count one answer with status CODE (SERIES None: refused before routing)."""
        codes = self._refusals if series is None else series.codes
        child = codes.get(code)
        if child is None:
            labels = ("", "", "", "") if series is None else series.labels
            child = codes[code] = self.requests.labels(*labels, str(code))
        child.inc()

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
