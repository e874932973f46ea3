"""Gateway traffic as the tables show it: one summary per deployment, one series per version.

Pure functions of `DeploymentTraffic`; `None` wherever there was no traffic to measure.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.gateway import DeploymentTraffic, VersionTraffic


@dataclass(frozen=True)
class TrafficSummary:
    """A deployment's traffic over the queried range, all versions together."""

    requests_per_s: float | None = None
    error_rate: float | None = None
    p95_s: float | None = None
    ttft_p95_s: float | None = None
    steps_per_block: float | None = None
    tokens_per_forward: float | None = None


def _span_s(traffic: DeploymentTraffic) -> float:
    return max(0.0, (traffic.until - traffic.since).total_seconds())


def _weighted(versions: list[VersionTraffic], field: str) -> float | None:
    # Means over versions, weighted by requests: the canary's few requests count for little.
    pairs = [(getattr(v, field), v.requests) for v in versions if getattr(v, field) is not None]
    weight = sum(w for _, w in pairs)
    if not pairs:
        return None
    if weight == 0:
        return sum(x for x, _ in pairs) / len(pairs)
    return sum(x * w for x, w in pairs) / weight


def _worst(versions: list[VersionTraffic], field: str) -> float | None:
    # Quantiles do not average: the worse version's is the one to watch.
    known = [getattr(v, field) for v in versions if getattr(v, field) is not None]
    return max(known) if known else None


def summarize(traffic: DeploymentTraffic | None) -> TrafficSummary:
    """The deployment-wide figures of TRAFFIC (None: no traffic data at all)."""
    if traffic is None:
        return TrafficSummary()
    versions = traffic.versions
    requests = sum(v.requests for v in versions)
    span = _span_s(traffic)
    return TrafficSummary(
        requests_per_s=requests / span if span else None,
        error_rate=sum(v.errors for v in versions) / requests if requests else None,
        p95_s=_worst(versions, "latency_p95_s"),
        ttft_p95_s=_worst(versions, "ttft_p95_s"),
        steps_per_block=_weighted(versions, "steps_per_block"),
        tokens_per_forward=_weighted(versions, "tokens_per_forward"),
    )


def request_rates(traffic: DeploymentTraffic | None) -> dict[int, list[float]]:
    """Per version id, requests per second at each step of its series, oldest first."""
    if traffic is None or traffic.step_s <= 0:
        return {}
    return {s.version_id: [p.requests / traffic.step_s for p in s.points] for s in traffic.series}


def p95_series(traffic: DeploymentTraffic | None) -> dict[int, list[float]]:
    """Per version id, the p95 latency (seconds) at each step that measured one."""
    if traffic is None:
        return {}
    return {
        s.version_id: [p.latency_p95_s for p in s.points if p.latency_p95_s is not None]
        for s in traffic.series
    }
