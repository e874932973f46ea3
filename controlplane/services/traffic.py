"""What the gateways served, per deployment and version: stored as reported, read back merged.

Each gateway posts a `TrafficReport` every few seconds; every (deployment, version, pool) window
of it becomes one `TrafficWindow` row. A query adds up the rows of every gateway whose window
ended in the range: counts add, histogram buckets add by position (all gateways use
`LATENCY_BUCKETS_S`), and quantiles come from the merged buckets the way Prometheus'
`histogram_quantile` computes them. Beside them, the engines' own diffusion figures (denoising
steps per block, tokens per forward) from the heartbeat samples of the version's instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import cast

import sqlalchemy as sa
from sqlalchemy import insert
from sqlmodel import Session, col, func, select

from controlplane.heartbeat.samples import histogram_count_name, histogram_sum_name
from controlplane.logs.reported import record_reported
from controlplane.models import Deployment, Instance, MetricSample, ModelVersion
from controlplane.models import TrafficWindow as WindowRow
from controlplane.services.deployments import get_deployment
from controlplane.services.errors import Invalid
from controlplane.services.placement import load_versions
from protocol.gateway import (
    LATENCY_BUCKETS_S,
    DeploymentTraffic,
    Pool,
    Tally,
    TrafficAccepted,
    TrafficPoint,
    TrafficReport,
    VersionSeries,
    VersionTraffic,
)

DEFAULT_RANGE = timedelta(minutes=5)
MAX_RANGE = timedelta(hours=24)
DEFAULT_STEP_S = 10
MAX_STEP_S = 3600
# A report from further ahead than this is a gateway whose clock is wrong, not a late window.
MAX_CLOCK_AHEAD = timedelta(minutes=2)
# Engine histograms whose means the traffic query reports, by VersionTraffic field.
DIFFUSION_HISTOGRAMS = {
    "steps_per_block": "dllm_denoising_steps_per_block",
    "tokens_per_forward": "dllm_tokens_per_forward",
}

# The counts of a window: stored as reported, added up as they are.
_COUNTS = ("requests", "errors_5xx", "errors_timeout", "errors_connect", "client_4xx",
           "output_tokens", "latency_sum_s", "ttft_sum_s")  # fmt: skip
# What a query reads of each stored window.
_QUERIED = ("version_id", "pool", "gateway", "ended_at", *_COUNTS, "latency_buckets",
            "ttft_buckets")  # fmt: skip


# --- reports -----------------------------------------------------------------------------------


def record_report(session: Session, now: datetime, report: TrafficReport) -> TrafficAccepted:
    """Store one row per window of REPORT, by the version id it carries; windows of unknown
    deployments, or of versions that are not of the deployment's model (deleted since the
    gateway's routing table, or never there) are skipped and named, never refused.
    The same report posted again (a retry after a lost answer) stores nothing twice.

    Invalid when the report ends more than `MAX_CLOCK_AHEAD` after NOW (the gateway's clock).
    """
    if report.ended_at - now > MAX_CLOCK_AHEAD:
        ahead = (report.ended_at - now).total_seconds()
        raise Invalid(
            f"ended_at is {ahead:.0f}s ahead of the control plane's clock: sync the gateway "
            "host's clock (NTP)"
        )
    names = {w.deployment for w in report.windows}
    deployments = {
        name: (dep_id, model_id)
        for name, dep_id, model_id in session.exec(
            select(Deployment.name, Deployment.id, Deployment.model_id).where(
                col(Deployment.name).in_(names)
            )
        ).all()
    }
    # The model of each version id named: a window counts only for a version of its
    # deployment's own model, whatever id the gateway sends.
    model_of = {
        vid: model_id
        for vid, model_id in session.exec(
            select(ModelVersion.id, ModelVersion.model_id).where(
                col(ModelVersion.id).in_({w.version_id for w in report.windows})
            )
        ).all()
    }
    # A gateway posts a report again when it got no answer: what is stored already counts once.
    stored = set(
        session.exec(
            select(WindowRow.deployment_id, WindowRow.version_id, WindowRow.pool).where(
                WindowRow.gateway == report.gateway,
                WindowRow.started_at == report.started_at,
                WindowRow.ended_at == report.ended_at,
            )
        ).all()
    )
    rows, skipped, again = [], [], 0
    for window in report.windows:
        dep = deployments.get(window.deployment)
        version_id = window.version_id
        if dep is None or model_of.get(version_id) != dep[1]:
            skipped.append(f"{window.deployment} version {version_id}")
            continue
        if (dep[0], version_id, window.pool) in stored:
            again += 1
            continue
        rows.append(
            {
                "deployment_id": dep[0],
                "version_id": version_id,
                "pool": window.pool,
                "gateway": report.gateway,
                "started_at": report.started_at,
                "ended_at": report.ended_at,
                **window.model_dump(include={*_COUNTS, "latency_buckets", "ttft_buckets"}),
            }
        )
    if rows:
        session.execute(insert(WindowRow), rows)
    record_reported(session, report)
    return TrafficAccepted(accepted=len(rows) + again, skipped=skipped)


# --- queries -----------------------------------------------------------------------------------


def histogram_quantile(
    q: float, buckets: Sequence[int], bounds: Sequence[float] = LATENCY_BUCKETS_S
) -> float | None:
    """The Q-quantile of a histogram of per-bucket counts over BOUNDS plus a last +Inf bucket,
    as Prometheus' `histogram_quantile` estimates it: linear inside the bucket the rank falls in
    (the first bucket starts at 0), the last finite bound when it falls in +Inf. None when empty.
    """
    total = sum(buckets)
    if total <= 0:
        return None
    rank = q * total
    below = 0
    for i, count in enumerate(buckets):
        if count > 0 and below + count >= rank:
            if i >= len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


@dataclass
class _Merged(Tally):
    """Windows added up, with what a series point needs."""

    def point(self, time: datetime) -> TrafficPoint:
        """This step of a series."""
        return TrafficPoint(
            time=time,
            requests=self.requests,
            errors=self.errors,
            output_tokens=self.output_tokens,
            latency_p95_s=histogram_quantile(0.95, self.latency_buckets),
            ttft_p95_s=histogram_quantile(0.95, self.ttft_buckets),
        )


def traffic_range(
    now: datetime, since: datetime | None, until: datetime | None, step_s: int | None
) -> tuple[datetime, datetime, int]:
    """The range and step a query asked for, with the defaults filled in, or Invalid.

    Times without a zone are UTC."""
    since = since.replace(tzinfo=UTC) if since and since.tzinfo is None else since
    until = until.replace(tzinfo=UTC) if until and until.tzinfo is None else until
    until = until or now
    since = since or until - DEFAULT_RANGE
    step = DEFAULT_STEP_S if step_s is None else step_s
    if not 1 <= step <= MAX_STEP_S:
        raise Invalid(f"step_s must be between 1 and {MAX_STEP_S} seconds, not {step}")
    if since >= until:
        raise Invalid(f"since ({since.isoformat()}) must be before until ({until.isoformat()})")
    if until - since > MAX_RANGE:
        raise Invalid("the range from since to until may span at most 24 hours")
    return since, until, step


def deployment_traffic(
    session: Session,
    now: datetime,
    name: str,
    since: datetime | None = None,
    until: datetime | None = None,
    step_s: int | None = None,
    *,
    whole_windows: bool = False,
) -> DeploymentTraffic:
    """Deployment NAME's traffic, merged over every gateway's windows that ended in
    (since, until], per version, with a series of `step_s` steps and the engines' diffusion
    figures. Defaults: until now, since five minutes before, steps of 10 s. `whole_windows`
    keeps only windows that also started at or after `since` (a rollout's analysis: requests
    served under the previous weight stay out of the interval)."""
    since, until, step = traffic_range(now, since, until, step_s)
    deployment = get_deployment(session, name)
    assert deployment.id is not None
    # Columns, not ORM objects: a day of windows is tens of thousands of rows.
    conditions = [
        col(WindowRow.deployment_id) == deployment.id,
        col(WindowRow.ended_at) > since,
        col(WindowRow.ended_at) <= until,
    ]
    if whole_windows:
        conditions.append(col(WindowRow.started_at) >= since)
    rows = session.execute(
        sa.select(*(col(getattr(WindowRow, name)) for name in _QUERIED))
        .where(*conditions)
        .order_by(col(WindowRow.ended_at), col(WindowRow.id))
    ).all()
    totals: dict[int, _Merged] = {}
    steps: dict[int, dict[int, _Merged]] = {}
    pools: dict[int, Pool] = {}
    gateways = set()
    for row in rows:
        # Steps are (k*step, (k+1)*step] on the epoch, labelled by their end, so the same
        # window lands in the same step whatever the query's range.
        k = math.ceil(row.ended_at.timestamp() / step)
        steps.setdefault(row.version_id, {}).setdefault(k, _Merged()).add(row)
        pools[row.version_id] = cast(Pool, row.pool)  # oldest first: the latest wins
        gateways.add(row.gateway)
    for vid, by_step in steps.items():
        for merged in by_step.values():
            totals.setdefault(vid, _Merged()).add(merged)
    diffusion = _diffusion_means(session, deployment.id, since, until)
    version_ids = set(totals) | set(diffusion)
    labels = {vid: v.label for vid, v in load_versions(session, list(version_ids)).items()}
    versions = []
    for vid in sorted(version_ids, key=lambda v: labels.get(v, "")):
        merged = totals.get(vid, _Merged())
        means = diffusion.get(vid, {})
        versions.append(
            VersionTraffic(
                version_id=vid,
                version=labels.get(vid, ""),
                pool=pools.get(vid),
                requests=merged.requests,
                errors_5xx=merged.errors_5xx,
                errors_timeout=merged.errors_timeout,
                errors_connect=merged.errors_connect,
                client_4xx=merged.client_4xx,
                output_tokens=merged.output_tokens,
                latency_buckets=merged.latency_buckets,
                latency_sum_s=merged.latency_sum_s,
                ttft_buckets=merged.ttft_buckets,
                ttft_sum_s=merged.ttft_sum_s,
                error_rate=merged.errors / merged.requests if merged.requests else None,
                latency_p50_s=histogram_quantile(0.50, merged.latency_buckets),
                latency_p95_s=histogram_quantile(0.95, merged.latency_buckets),
                latency_p99_s=histogram_quantile(0.99, merged.latency_buckets),
                ttft_p50_s=histogram_quantile(0.50, merged.ttft_buckets),
                ttft_p95_s=histogram_quantile(0.95, merged.ttft_buckets),
                steps_per_block=means.get("steps_per_block"),
                tokens_per_forward=means.get("tokens_per_forward"),
            )
        )
    series = [
        VersionSeries(
            version_id=vid,
            version=labels.get(vid, ""),
            points=[
                merged.point(datetime.fromtimestamp(k * step, tz=until.tzinfo))
                for k, merged in sorted(steps[vid].items())
            ],
        )
        for vid in sorted(steps, key=lambda v: labels.get(v, ""))
    ]
    return DeploymentTraffic(
        deployment=name,
        since=since,
        until=until,
        step_s=step,
        gateways=len(gateways),
        versions=versions,
        series=series,
    )


def canary_share(session: Session, now: datetime, name: str, since: datetime) -> float | None:
    """The canary pool's share of deployment NAME's requests in the windows from SINCE to NOW
    (whole windows, as an analysis counts them; at most `MAX_RANGE`): the split clients got,
    to set against the canary's weight. None without requests."""
    since = max(since, now - MAX_RANGE)
    if since >= now:
        return None
    traffic = deployment_traffic(session, now, name, since, now, whole_windows=True)
    total = sum(v.requests for v in traffic.versions)
    canary = sum(v.requests for v in traffic.versions if v.pool == "canary")
    return canary / total if total else None


def _diffusion_means(
    session: Session, deployment_id: int, since: datetime, until: datetime
) -> dict[int, dict[str, float]]:
    """Mean of each diffusion histogram per version over the range: the sum of its `_sum`
    samples over the sum of its `_count` samples, over the instances of the version (one query).

    Samples are joined to instances that still exist: those of deleted instances are gone.
    """
    names = {}
    for key, metric in DIFFUSION_HISTOGRAMS.items():
        names[histogram_sum_name(metric)] = (key, "sum")
        names[histogram_count_name(metric)] = (key, "count")
    rows = session.exec(
        select(Instance.version_id, MetricSample.name, func.sum(MetricSample.value))
        .join(Instance, col(Instance.id) == col(MetricSample.instance_id))
        .where(
            col(Instance.deployment_id) == deployment_id,
            col(MetricSample.name).in_(names),
            col(MetricSample.time) >= since,
            col(MetricSample.time) <= until,
        )
        .group_by(col(Instance.version_id), col(MetricSample.name))
    ).all()
    totals: dict[tuple[int, str], dict[str, float]] = {}
    for version_id, sample_name, total in rows:
        key, part = names[sample_name]
        totals.setdefault((version_id, key), {})[part] = float(total or 0.0)
    means: dict[int, dict[str, float]] = {}
    for (version_id, key), sums in totals.items():
        count = sums.get("count", 0.0)
        if count > 0:
            means.setdefault(version_id, {})[key] = sums.get("sum", 0.0) / count
    return means
