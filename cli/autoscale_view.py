"""How a deployment's autoscaling reads on the command line: `min/current/max` with its standby,
the policy as a sentence, the last decision, and the role and load of each instance. Text out,
no I/O; the clock comes in as `now`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cli.output import Column
from runtime.durations import format_duration

if TYPE_CHECKING:
    from protocol.autoscale import AutoscaleDecision, AutoscalePolicy, AutoscaleStatus
    from protocol.rest import DeploymentOut, InstanceOut


def _aware(moment: datetime) -> datetime:
    # The API's datetimes are UTC; one written without a zone is read as UTC.
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def ago(moment: datetime, now: datetime) -> str:
    """How long before NOW MOMENT was: `2m ago`, `just now` for a moment not yet past."""
    seconds = (_aware(now) - _aware(moment)).total_seconds()
    return f"{format_duration(seconds)} ago" if seconds >= 1 else "just now"


def timestamp(moment: datetime) -> str:
    """MOMENT in UTC as `2026-01-01 12:00:00Z`."""
    return _aware(moment).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def serving_count(instances: Iterable[InstanceOut]) -> int:
    """Instances in the gateway's pools: neither standby nor retiring."""
    return sum(1 for i in instances if not i.standby and not i.retiring)


def replicas_text(policy: AutoscalePolicy, status: AutoscaleStatus | None, serving: int) -> str:
    """`1/3/8` (min/current/max serving instances), then `+1 standby` when it keeps any.

    Current is what the autoscaler wants now; before it has said (no status yet), the serving
    instances the deployment has.
    """
    current = status.replicas if status is not None else serving
    standby = status.standby if status is not None else policy.standby
    text = f"{policy.min}/{current}/{policy.max}"
    return f"{text} +{standby} standby" if standby else text


def replicas_cell(row: Mapping[str, Any]) -> str:
    """The AUTOSCALE column of a deployment as the API sends it; `-` when it is not autoscaled."""
    from protocol.autoscale import AutoscalePolicy, AutoscaleStatus

    if not row.get("autoscale"):
        return "-"
    policy = AutoscalePolicy.model_validate(row["autoscale"])
    raw_status = row.get("autoscale_status")
    status = AutoscaleStatus.model_validate(raw_status) if raw_status else None
    serving = sum(
        1 for i in row.get("instances") or [] if not i.get("standby") and not i.get("retiring")
    )
    return replicas_text(policy, status, serving)


def decision_text(decision: AutoscaleDecision, now: datetime) -> str:
    """`up 2->3 2m ago: queue 6.1 per instance over 4 for 30s`."""
    change = f"{decision.action} {decision.from_replicas}->{decision.to_replicas}"
    reason = f": {decision.reason}" if decision.reason else ""
    return f"{change} {ago(decision.time, now)}{reason}"


def pinned_text(status: AutoscaleStatus, now: datetime) -> str | None:
    """`since 2026-01-01 12:00:00Z (12m ago)` while it wants more than max, else None."""
    since = status.pinned_at_max_since
    return None if since is None else f"since {timestamp(since)} ({ago(since, now)})"


def starved_text(status: AutoscaleStatus, now: datetime) -> str | None:
    """`REASON, since ... (4m ago)` while fewer instances are placed than it wants, else None."""
    since = status.starved_since
    if since is None:
        return None
    reason = status.starved_reason or "fewer instances placed than wanted"
    return f"{reason}, since {timestamp(since)} ({ago(since, now)})"


def _number(value: float) -> str:
    return f"{value:g}"


def policy_text(policy: AutoscalePolicy) -> str:
    """The policy as a sentence: when it scales up and down, and how it waits."""
    text = (
        f"up when more than {_number(policy.target_queue)} requests wait per serving instance "
        f"for {format_duration(policy.up_after_s)}; down when under "
        f"{_number(policy.target_utilization * 100)}% of their capacity is busy for "
        f"{format_duration(policy.down_after_s)}; {format_duration(policy.cooldown_s)} "
        "between changes."
    )
    if policy.min == 0:
        text += (
            " Idle, it stops its last instance; a request then waits up to "
            f"{format_duration(policy.cold_start_timeout_s)} while one starts."
        )
    return text


def standing_text(status: AutoscaleStatus) -> str:
    """`3 of 3 serving ready, 1 of 1 standby ready, 2.0 waiting per instance, 65% busy`."""
    parts = [f"{status.serving_ready} of {status.replicas} serving ready"]
    if status.standby:
        parts.append(f"{status.standby_ready} of {status.standby} standby ready")
    if status.queue_per_instance is not None:
        parts.append(f"{status.queue_per_instance:.1f} waiting per instance")
    if status.utilization is not None:
        parts.append(f"{status.utilization * 100:.0f}% busy")
    return ", ".join(parts)


def status_text(status: AutoscaleStatus, now: datetime) -> str:
    """Where it stands: ready counts, load, the last decision, and pinned or starved."""
    text = f"Now {standing_text(status)}."
    if status.last_decision is not None:
        text += f" Last change: {decision_text(status.last_decision, now)}."
    pinned = pinned_text(status, now)
    if pinned:
        text += f" Pinned at max {pinned}: it wants more instances than max allows."
    starved = starved_text(status, now)
    if starved:
        text += f" Starved: {starved}."
    return text


def summary(deployment: DeploymentOut, now: datetime) -> str:
    """One paragraph on DEPLOYMENT's autoscaling (`dctl deploy autoscale`)."""
    policy, status = deployment.autoscale, deployment.autoscale_status
    if policy is None:
        serving = serving_count(deployment.instances)
        return f"deployment {deployment.name}: not autoscaled, {serving} serving instance(s)."
    counts = replicas_text(policy, status, serving_count(deployment.instances))
    text = (
        f"deployment {deployment.name} autoscales {counts} (min/current/max serving "
        f"instances): {policy_text(policy)}"
    )
    return text + (f" {status_text(status, now)}" if status is not None else "")


def _constant(text: str | None) -> Callable[[Mapping[str, Any]], str | None]:
    return lambda _row: text


def show_fields(deployment: DeploymentOut, now: datetime) -> list[Column]:
    """`dctl deploy show`'s lines on autoscaling beyond the AUTOSCALE counts; none when off."""
    policy, status = deployment.autoscale, deployment.autoscale_status
    if policy is None:
        return []
    lines: dict[str, str | None] = {"autoscale policy": policy_text(policy)}
    if status is not None:
        decision = status.last_decision
        lines["autoscale now"] = standing_text(status)
        lines["last decision"] = decision_text(decision, now) if decision else None
        if status.pinned_at_max_since is not None:
            lines["pinned at max"] = pinned_text(status, now)
        if status.starved_since is not None:
            lines["starved"] = starved_text(status, now)
    return [(header, _constant(text)) for header, text in lines.items()]
