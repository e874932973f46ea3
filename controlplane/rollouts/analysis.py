"""The canary analysis: canary against stable over one interval, metric by metric.

Traffic figures (error rate, p95 latency, p95 TTFT) come from the gateways' reports, diffusion
figures (mean denoising steps per block, mean tokens per forward) from the engines' heartbeats:
a canary whose decoding got slower is a regression even when it answers every request. Too few
requests in either pool makes the whole interval inconclusive (the step is extended, never
promoted on no data). A metric without figures on either side is inconclusive on its own and
does not hold the step back; any failing metric fails the interval.

The diffusion figures measure a family's own decoding: an SDAR block is a few tokens unmasked
in steps, a DiffusionGemma canvas is a whole canvas of noise denoised; a step of one is not a
step of the other, nor is a forward. So when the two versions were sized by different model
families at registration (`MemoryPlan.family`), steps per block and tokens per forward are
shown with both figures but judged "inconclusive", noted as not comparable: a rollout from one
family to another is judged on errors, latency and restarts, which mean the same for both. A
version registered without a family (before it was recorded) is compared as before.

The gateways' passive health can starve a canary: an instance that keeps failing is ejected, its
requests go to stable, and at weight 20 it serves 2% of them. Its figures then say little (the
few requests it got) while the operator believes a fifth of the traffic judged it. So the
interval also sets the canary's served share against its weight: `starved` (see `is_starved`)
when it is far below, unless a metric already fails. The controller holds the step for one
starved interval (the gateways may not have routed to a canary that just became ready) and
pauses a rollout starved two intervals running, with the figures in its reason: promoting
would judge a canary on nothing, extending would wait forever, and aborting would blame the
canary for what may be a gateway's doing; the operator looks (`dctl_gateway_pool_share`,
`dctl_gateway_ejections`) and resumes or aborts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from controlplane.rollouts.ports import histogram_quantile
from protocol.gateway import LATENCY_BUCKETS_S, VersionTraffic
from protocol.rollout_policy import RolloutPolicy
from protocol.rollouts import Analysis, MetricUnit, MetricVerdict, Verdict

# Latency ratios of tiny figures are noise (8 ms against 5 ms is "1.6x"): a canary fails a
# latency or TTFT ratio only when it is also this much slower in absolute terms.
LATENCY_SLACK_S = 0.05
# A canary's p95 over a few dozen requests is at the mercy of a handful of slow ones (a pause
# of the host hits both pools, but weighs far more in the smaller one). So a latency ratio
# fails only when the canary has significantly more requests above the limit than the stable
# pool's own rate at that limit (at least 5%) explains: binomial tail below this.
SIGNIFICANCE = 0.01
# A canary is starved when it served under this fraction of its weight's share of the requests,
# over at least the policy's `min_requests` requests in both pools together, and the shortfall
# is significant (so a low weight over few requests, where 0 canary requests is likely, is not).
STARVED_FRACTION = 0.5


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
    # The model family each version was sized by at registration; None: not recorded.
    stable_family: str | None = None
    canary_family: str | None = None
    # The engine kind each pool runs: only the dctl engine reports the diffusion figures.
    stable_engine: str = "dctl"
    canary_engine: str = "dctl"

    def families_differ(self) -> bool:
        """Whether both versions' families are known and are not the same."""
        s, c = self.stable_family, self.canary_family
        return s is not None and c is not None and s != c


def analyse(interval: Interval, policy: RolloutPolicy) -> Analysis:
    """The verdict of one interval under POLICY (a resolved policy: every field set)."""
    stable, canary = interval.stable, interval.canary
    stable_n = stable.requests if stable else 0
    canary_n = canary.requests if canary else 0
    minimum = policy.min_requests or 1
    share = _served_share(stable_n, canary_n, interval.weight, minimum)
    across = _not_comparable_note(interval) if interval.families_differ() else None
    unreported = _unreported_note(interval)
    metrics = [
        _error_rate(stable, canary, policy.max_error_rate_increase or 0.0, minimum),
        _latency(
            "p95 latency",
            stable.latency_buckets if stable else None,
            canary.latency_buckets if canary else None,
            policy.max_latency_ratio or 1.0,
        ),
        _latency(
            "p95 TTFT",
            stable.ttft_buckets if stable else None,
            canary.ttft_buckets if canary else None,
            policy.max_ttft_ratio or 1.0,
        ),
        _ratio_at_most(
            "steps per block",
            stable.steps_per_block if stable else None,
            canary.steps_per_block if canary else None,
            policy.max_steps_per_block_ratio or 1.0,
            across,
            unreported,
        ),
        _ratio_at_least(
            "tokens per forward",
            stable.tokens_per_forward if stable else None,
            canary.tokens_per_forward if canary else None,
            policy.min_tokens_per_forward_ratio or 0.0,
            across,
            unreported,
        ),
        MetricVerdict(
            metric="canary restarts",
            unit="count",
            stable=None,
            canary=float(interval.canary_restarts),
            limit="0",
            verdict="fail" if interval.canary_restarts > 0 else "pass",
        ),
        share,
    ]
    verdict: Verdict
    if any(m.verdict == "fail" for m in metrics):
        verdict = "fail"
    elif share.verdict == "starved":
        verdict = "starved"
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
        f"{m.metric} {_figure(m.canary, m.unit)} vs stable {_figure(m.stable, m.unit)} "
        f"(limit {m.limit})"
        for m in analysis.metrics
        if m.verdict == "fail"
    ]
    return "; ".join(parts)


def starved_reason(analysis: Analysis) -> str:
    """Why a starved interval cannot be judged, with the figures, for the pause's reason."""
    return (
        f"starved: the canary served {analysis.canary_requests} of "
        f"{analysis.canary_requests + analysis.stable_requests} requests "
        f"({_percent(served_share(analysis.stable_requests, analysis.canary_requests))}) at weight "
        f"{analysis.weight}%, too few to judge it; the gateways may be ejecting it "
        "(dctl_gateway_pool_share, dctl_gateway_ejections): resume or abort"
    )


def _figure(value: float | None, unit: MetricUnit) -> str:
    if value is None:
        return "-"
    return f"{value:.4g} s" if unit == "seconds" else f"{value:.4g}"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.3g}%"


def served_share(stable_requests: int, canary_requests: int) -> float | None:
    """The canary's share of the requests both pools served (None: no requests)."""
    total = stable_requests + canary_requests
    return canary_requests / total if total > 0 else None


def is_starved(stable_requests: int, canary_requests: int, weight: int, minimum: int) -> bool:
    """Whether a canary at WEIGHT percent served far less than that: under `STARVED_FRACTION` of
    its weight, over at least MINIMUM requests in both pools, and with so few canary requests
    that a fair split at WEIGHT would give as few less than `SIGNIFICANCE` of the time."""
    total = stable_requests + canary_requests
    if total < minimum or not 0 < weight < 100:
        return False
    expected = weight / 100
    if canary_requests >= total * expected * STARVED_FRACTION:
        return False
    # P(X <= k) for X ~ Binomial(total, expected), the chance of so few under a fair split, as
    # the upper tail of the stable pool's count (k + 1 terms to sum, no 1 - p cancellation).
    stable_tail = binomial_tail(total, total - canary_requests, 1.0 - expected)
    return stable_tail < SIGNIFICANCE


def _served_share(stable_n: int, canary_n: int, weight: int, minimum: int) -> MetricVerdict:
    """Each pool's share of the requests, the canary's against its weight."""
    canary = served_share(stable_n, canary_n)
    stable = None if canary is None else 1.0 - canary
    limit = f">= {STARVED_FRACTION:g}x weight ({weight}%)"
    note = f"{canary_n} of {stable_n + canary_n} requests"
    verdict: Verdict
    if is_starved(stable_n, canary_n, weight, minimum):
        verdict = "starved"
    elif stable_n + canary_n < minimum:
        verdict = "inconclusive"
    else:
        verdict = "pass"
    return MetricVerdict(
        metric="served share", unit="ratio", stable=stable, canary=canary, limit=limit,
        verdict=verdict, note=note,
    )  # fmt: skip


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
            unit="ratio",
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
            metric="error rate", unit="ratio", stable=s, canary=c, limit=limit,
            verdict="fail" if certain else "inconclusive",
            note=f"{n} requests, {errors} errors",
        )  # fmt: skip
    verdict: Verdict = "fail" if c - s > increase else "pass"
    return MetricVerdict(
        metric="error rate", unit="ratio", stable=s, canary=c, limit=limit, verdict=verdict
    )


def _latency(
    metric: str, stable: Sequence[int] | None, canary: Sequence[int] | None, ratio: float
) -> MetricVerdict:
    """p95 of canary against RATIO x stable's p95, judged as in `SIGNIFICANCE`'s comment."""
    limit = f"<= {ratio:g}x stable"
    s = histogram_quantile(0.95, stable) if stable else None
    c = histogram_quantile(0.95, canary) if canary else None
    if s is None or c is None or s <= 0 or stable is None or canary is None:
        return MetricVerdict(
            metric=metric, unit="seconds", stable=s, canary=c, limit=limit,
            verdict="inconclusive", note="no figures",
        )  # fmt: skip
    bound = s * ratio
    if c <= bound or c - s <= LATENCY_SLACK_S:
        return MetricVerdict(
            metric=metric, unit="seconds", stable=s, canary=c, limit=limit, verdict="pass"
        )
    n = sum(canary)
    slow = round(share_above(canary, bound) * n)
    expected = max(share_above(stable, bound), 0.05)
    p_value = binomial_tail(n, slow, expected)
    verdict: Verdict = "fail" if p_value < SIGNIFICANCE else "pass"
    note = f"{slow}/{n} above the limit, p={p_value:.2g}"
    return MetricVerdict(
        metric=metric, unit="seconds", stable=s, canary=c, limit=limit, verdict=verdict,
        note=note,
    )  # fmt: skip


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


def _not_comparable_note(interval: Interval) -> str:
    """The note of a diffusion figure the two versions' families make incomparable."""
    return (
        f"not comparable: {interval.stable_family} vs {interval.canary_family} "
        "(each family decodes its own way)"
    )


def _unreported_note(interval: Interval) -> str | None:
    """Why the diffusion figures are not analysed when a pool's engine does not report them."""
    kinds = [k for k in (interval.stable_engine, interval.canary_engine) if k != "dctl"]
    if not kinds:
        return None
    return f"n/a: the {kinds[0]} engine does not report it"


def _unjudged(
    metric: str,
    stable: float | None,
    canary: float | None,
    limit: str,
    note: str,
    verdict: Verdict = "inconclusive",
) -> MetricVerdict:
    """Both figures, for the operator, but no verdict on them; NOTE says why (`n/a`: an engine
    that does not report the figure, so not analysed at all)."""
    return MetricVerdict(
        metric=metric, unit="number", stable=stable, canary=canary, limit=limit,
        verdict=verdict, note=note,
    )  # fmt: skip


def _ratio_at_most(
    metric: str,
    stable: float | None,
    canary: float | None,
    ratio: float,
    across: str | None,
    unreported: str | None = None,
) -> MetricVerdict:
    return _ratio(metric, stable, canary, ratio, "<=", across, unreported)


def _ratio_at_least(
    metric: str,
    stable: float | None,
    canary: float | None,
    ratio: float,
    across: str | None,
    unreported: str | None = None,
) -> MetricVerdict:
    return _ratio(metric, stable, canary, ratio, ">=", across, unreported)


def _ratio(
    metric: str,
    stable: float | None,
    canary: float | None,
    ratio: float,
    bound: str,
    across: str | None,
    unreported: str | None,
) -> MetricVerdict:
    """The canary's figure held to RATIO x stable's, from above (`<=`) or below (`>=`)."""
    limit = f"{bound} {ratio:g}x stable"
    if unreported is not None:
        return _unjudged(metric, stable, canary, limit, unreported, "n/a")
    if across is not None:
        return _unjudged(metric, stable, canary, limit, across)
    if stable is None or canary is None or stable <= 0:
        return _unjudged(metric, stable, canary, limit, "no figures")
    worse = canary > stable * ratio if bound == "<=" else canary < stable * ratio
    verdict: Verdict = "fail" if worse else "pass"
    return MetricVerdict(
        metric=metric, unit="number", stable=stable, canary=canary, limit=limit, verdict=verdict
    )
