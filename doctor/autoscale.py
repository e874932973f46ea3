"""Autoscaled deployments held at a limit: pinned at their maximum (the load wants more serving
instances than `max` allows, so requests queue) or starved (fewer instances are placed than the
autoscaler wants: no free GPUs on the placement's hosts). The autoscaler reports both with the
time it began; a deployment that is neither, or not autoscaled, says nothing.
"""

from __future__ import annotations

from datetime import UTC, datetime

from doctor.findings import Evidence, Finding, FleetSnapshot, Severity
from protocol.autoscale import AutoscalePolicy, AutoscaleStatus
from protocol.rest import DeploymentOut

RULE = "autoscale.limits"


def _time(moment: datetime) -> str:
    # The API's datetimes are UTC; one without a zone is read as UTC.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _load(status: AutoscaleStatus) -> Evidence:
    figures: Evidence = {"replicas": status.replicas, "serving_ready": status.serving_ready}
    if status.queue_per_instance is not None:
        figures["queue_per_instance"] = round(status.queue_per_instance, 2)
    if status.utilization is not None:
        figures["utilization"] = round(status.utilization, 2)
    return figures


def _widen(dep: DeploymentOut) -> str:
    """What widens DEP's placement: more labelled hosts, or more named ones."""
    labels = " ".join(f"{k}={v}" for k, v in dep.placement.labels.items())
    if labels:
        return f"label more hosts into its placement (`dctl host label HOST {labels}`)"
    return f"add hosts to its placement (now {', '.join(dep.placement.hosts) or 'none'})"


def _pinned(dep: DeploymentOut, policy: AutoscalePolicy, status: AutoscaleStatus) -> Finding:
    assert status.pinned_at_max_since is not None
    since = _time(status.pinned_at_max_since)
    return Finding(
        rule=RULE,
        severity="warning",
        subject=f"deployment/{dep.name}",
        summary=(
            f"autoscaler pinned at max {policy.max} since {since}: the load wants more serving "
            "instances than max allows, so requests queue"
        ),
        evidence={"max": policy.max, "pinned_at_max_since": since, **_load(status)},
        fix=(
            f"raise --max (`dctl deploy autoscale {dep.name} --max N`, N > {policy.max}) where "
            "GPUs are free, or add GPUs to its placement first"
        ),
    )


def _starved(dep: DeploymentOut, policy: AutoscalePolicy, status: AutoscaleStatus) -> Finding:
    assert status.starved_since is not None
    since = _time(status.starved_since)
    wanted = status.replicas + status.standby
    reason = status.starved_reason or "no reason given"
    # Below its minimum it serves less than the operator said it always must.
    severity: Severity = "error" if status.serving_ready < policy.min else "warning"
    below = f"; {status.serving_ready} serving ready, under its min {policy.min}"
    return Finding(
        rule=RULE,
        severity=severity,
        subject=f"deployment/{dep.name}",
        summary=(
            f"autoscaler starved since {since}: {status.placed} of {wanted} instance(s) placed "
            f"({reason})" + (below if severity == "error" else "")
        ),
        evidence={
            "placed": status.placed,
            "wanted": wanted,
            "starved_since": since,
            "reason": reason,
            **_load(status),
        },
        fix=(
            "free GPUs on its placement's hosts (scale down or delete deployments there), or "
            + _widen(dep)
        ),
    )


def limits(snap: FleetSnapshot) -> list[Finding]:
    """Per autoscaled deployment: pinned at max (warning), starved of GPUs (warning; an error
    when fewer serving instances are ready than its min)."""
    found = []
    for dep in snap.deployments:
        policy, status = dep.autoscale, dep.autoscale_status
        if policy is None or status is None:
            continue
        if status.starved_since is not None:
            found.append(_starved(dep, policy, status))
        if status.pinned_at_max_since is not None:
            found.append(_pinned(dep, policy, status))
    return found
