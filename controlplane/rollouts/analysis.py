"""The canary analysis: canary against stable over one interval, metric by metric.

Traffic figures (error rate, p95 latency, p95 TTFT) come from the gateways' reports, diffusion
figures (mean denoising steps per block, mean tokens per forward) from the engines' heartbeats:
a canary whose decoding got slower is a regression even when it answers every request. Too few
requests in either pool makes the whole interval inconclusive (the step is extended, never
promoted on no data). A metric without figures on either side is inconclusive on its own and
does not hold the step back; any failing metric fails the interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from controlplane.rollouts.ports import histogram_quantile
from protocol.gateway import LATENCY_BUCKETS_S, VersionTraffic
from protocol.rollout_policy import RolloutPolicy
from protocol.rollouts import Analysis, MetricVerdict, Verdict

# Latency ratios of tiny figures are noise (8 ms against 5 ms is "1.6x"): a canary fails a
# latency or TTFT ratio only when it is also this much slower in absolute terms.
LATENCY_SLACK_S = 0.05
# A canary's p95 over a few dozen requests is at the mercy of a handful of slow ones (a pause
# of the host hits both pools, but weighs far more in the smaller one). So a latency ratio
# fails only when the canary has significantly more requests above the limit than the stable
# pool's own rate at that limit (at least 5%) explains: binomial tail below this.
SIGNIFICANCE = 0.01


@dataclass(frozen=True)
class Interval:
    """What one interval of one step is judged on."""

    time: datetime
    since: datetime
    step: int  # 1-based
    weight: int
    stable: VersionTraffic | None
    canary: VersionTraffic | None
    canary_restarts: int  # canary engine restarts since the step began


def analyse(interval: Interval, policy: RolloutPolicy) -> Analysis:
    """The verdict of one interval under POLICY (a resolved policy: every field set)."""
    stable, canary = interval.stable, interval.canary
    stable_n = stable.requests if stable else 0
    canary_n = canary.requests if canary else 0
    minimum = policy.min_requests or 1
    metrics = [
        _error_rate(stable, canary, policy.max_error_rate_increase or 0.0, minimum),
        _latency(
            "p95 latency (s)",
            stable.latency_buckets if stable else None,
            canary.latency_buckets if canary else None,
            policy.max_latency_ratio or 1.0,
        ),
        _latency(
            "p95 TTFT (s)",
            stable.ttft_buckets if stable else None,
            canary.ttft_buckets if canary else None,
            policy.max_ttft_ratio or 1.0,
        ),
        _ratio_at_most(
            "steps per block",
            stable.steps_per_block if stable else None,
            canary.steps_per_block if canary else None,
            policy.max_steps_per_block_ratio or 1.0,
        ),
        _ratio_at_least(
            "tokens per forward",
            stable.tokens_per_forward if stable else None,
            canary.tokens_per_forward if canary else None,
            policy.min_tokens_per_forward_ratio or 0.0,
        ),
        MetricVerdict(
            metric="canary restarts",
            stable=None,
            canary=float(interval.canary_restarts),
            limit="0",
            verdict="fail" if interval.canary_restarts > 0 else "pass",
        ),
    ]
    verdict: Verdict
    if any(m.verdict == "fail" for m in metrics):
        verdict = "fail"
    elif min(stable_n, canary_n) < minimum:
        verdict = "inconclusive"
    else:
        verdict = "pass"
    return Analysis(
        time=interval.time,
        step=interval.step,
        weight=interval.weight,
        since=interval.since,
        verdict=verdict,
        stable_requests=stable_n,
        canary_requests=canary_n,
        metrics=metrics,
    )


def failing_reason(analysis: Analysis) -> str:
    """The failing metrics with their figures, for an abort's reason."""
    parts = [
        f"{m.metric} {_figure(m.canary)} vs stable {_figure(m.stable)} (limit {m.limit})"
        for m in analysis.metrics
        if m.verdict == "fail"
    ]
    return "; ".join(parts)


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _error_rate(
    stable: VersionTraffic | None, canary: VersionTraffic | None, increase: float, minimum: int
) -> MetricVerdict:
    """Canary error rate at most stable's plus `increase`; judged only with requests on both."""
    s = stable.error_rate if stable else None
    c = canary.error_rate if canary else None
    limit = f"<= stable + {increase:g}"
    if s is None or c is None:
        return MetricVerdict(
            metric="error rate",
            stable=s,
            canary=c,
            limit=limit,
            verdict="inconclusive",
            note="no requests",
        )
    n = canary.requests if canary else 0
    if n < minimum:
        # Too few requests to judge, unless the errors already seen break the limit even if
        # every request still missing to the minimum succeeds (a canary the gateway ejects
        # gets few requests, and is clearly bad).
        errors = canary.errors if canary else 0
        certain = errors / minimum - s > increase
        return MetricVerdict(
            metric="error rate", stable=s, canary=c, limit=limit,
            verdict="fail" if certain else "inconclusive",
            note=f"{n} requests, {errors} errors",
        )  # fmt: skip
    verdict: Verdict = "fail" if c - s > increase else "pass"
    return MetricVerdict(metric="error rate", stable=s, canary=c, limit=limit, verdict=verdict)


def _latency(
    metric: str, stable: Sequence[int] | None, canary: Sequence[int] | None, ratio: float
) -> MetricVerdict:
    """p95 of canary against RATIO x stable's p95, judged as in `SIGNIFICANCE`'s comment."""
    limit = f"<= {ratio:g}x stable"
    s = histogram_quantile(0.95, stable) if stable else None
    c = histogram_quantile(0.95, canary) if canary else None
    if s is None or c is None or s <= 0 or stable is None or canary is None:
        return MetricVerdict(
            metric=metric, stable=s, canary=c, limit=limit, verdict="inconclusive",
            note="no figures",
        )  # fmt: skip
    bound = s * ratio
    if c <= bound or c - s <= LATENCY_SLACK_S:
        return MetricVerdict(metric=metric, stable=s, canary=c, limit=limit, verdict="pass")
    n = sum(canary)
    slow = round(share_above(canary, bound) * n)
    expected = max(share_above(stable, bound), 0.05)
    p_value = binomial_tail(n, slow, expected)
    verdict: Verdict = "fail" if p_value < SIGNIFICANCE else "pass"
    note = f"{slow}/{n} above the limit, p={p_value:.2g}"
    return MetricVerdict(metric=metric, stable=s, canary=c, limit=limit, verdict=verdict, note=note)


def share_above(buckets: Sequence[int], value: float) -> float:
    """The share of a histogram's observations above VALUE (linear inside its bucket)."""
    total = sum(buckets)
    if total <= 0:
        return 0.0
    above = 0.0
    for i, count in enumerate(buckets):
        lower = LATENCY_BUCKETS_S[i - 1] if i > 0 else 0.0
        upper = LATENCY_BUCKETS_S[i] if i < len(LATENCY_BUCKETS_S) else math.inf
        if lower >= value:
            above += count
        elif upper > value:
            width = upper - lower
            above += count * ((upper - value) / width if math.isfinite(width) else 1.0)
    return above / total


def binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), summed in log space (no overflow for large n)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [
        math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p
        + (n - i) * log_q
        for i in range(k, n + 1)
    ]  # fmt: skip
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def _ratio_at_most(
    metric: str, stable: float | None, canary: float | None, ratio: float
) -> MetricVerdict:
    limit = f"<= {ratio:g}x stable"
    if stable is None or canary is None or stable <= 0:
        return MetricVerdict(
            metric=metric,
            stable=stable,
            canary=canary,
            limit=limit,
            verdict="inconclusive",
            note="no figures",
        )
    verdict: Verdict = "fail" if canary > stable * ratio else "pass"
    return MetricVerdict(metric=metric, stable=stable, canary=canary, limit=limit, verdict=verdict)


def _ratio_at_least(
    metric: str, stable: float | None, canary: float | None, ratio: float
) -> MetricVerdict:
    limit = f">= {ratio:g}x stable"
    if stable is None or canary is None or stable <= 0:
        return MetricVerdict(
            metric=metric,
            stable=stable,
            canary=canary,
            limit=limit,
            verdict="inconclusive",
            note="no figures",
        )
    verdict: Verdict = "fail" if canary < stable * ratio else "pass"
    return MetricVerdict(metric=metric, stable=stable, canary=canary, limit=limit, verdict=verdict)
