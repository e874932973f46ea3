"""The changes a rollout goes through, shared by the API (by hand) and the controller (on its
own): canary size, weight, abort, pause, resume, promotion. Each writes the rollout row, re-plans
the deployment where instances must change, and records an Event; the caller commits.

A canary step of weight w runs ceil(w% of N) of the deployment's N instances (at least one,
never all: the stable pool keeps at least one while anything is analysed). Promotion moves the
remaining instances one at a time with all requests on the canary pool, then makes the canary
the stable pair.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from sqlmodel import Session, col, func, select

from controlplane.eventlog import record_event
from controlplane.models import Deployment, Host, Instance, ModelVersion, Rollout
from controlplane.rollouts.ports import bump_generation, load_versions, replan_deployment
from protocol.rollout_policy import RolloutPolicy
from protocol.rollouts import ACTIVE_STATES, RolloutPhase, RolloutState
from protocol.wire import InstanceState


def canary_size(weight: int, total: int, surge: int = 0) -> int:
    """Instances a step of WEIGHT percent runs on a deployment of TOTAL instances of its own,
    with up to SURGE extra ones: never the last stable one."""
    if weight >= 100:
        return total + surge
    return min(max(1, math.ceil(weight * total / 100)), max(total - 1, 0) + surge)


def surge_of(rollout: Rollout) -> int:
    """Extra canary instances the rollout may run beside the deployment's own."""
    return rollout.settings.surge


def own_total(session: Session, deployment: Deployment) -> int:
    """The deployment's own instances (surge ones, beyond its instances per host, left out)."""
    return session.exec(
        select(func.count())
        .select_from(Instance)
        .where(
            Instance.deployment_id == deployment.id,
            Instance.ordinal < deployment.instances_per_host,
        )
    ).one()


def policy_of(rollout: Rollout) -> RolloutPolicy:
    """The resolved policy a rollout was created with."""
    return rollout.settings.policy


def interval_of(rollout: Rollout) -> timedelta:
    """How long each of the rollout's steps is held."""
    return timedelta(seconds=policy_of(rollout).interval_s or 300.0)


def label(session: Session, version_id: int) -> str:
    """MODEL:VERSION of a version id ("(deleted)" when it is gone)."""
    found = load_versions(session, [version_id]).get(version_id)
    return found.label if found else f"(deleted version {version_id})"


def instance_total(session: Session, deployment_id: int) -> int:
    """The deployment's instances."""
    return session.exec(
        select(func.count()).select_from(Instance).where(Instance.deployment_id == deployment_id)
    ).one()


def ready_count(session: Session, deployment_id: int, version_id: int) -> int:
    """Instances of the deployment that serve VERSION now: ready and reporting its digest."""
    version = session.get(ModelVersion, version_id)
    if version is None:
        return 0
    return session.exec(
        select(func.count())
        .select_from(Instance)
        .where(
            Instance.deployment_id == deployment_id,
            Instance.version_id == version_id,
            Instance.desired_state == "running",
            Instance.observed_state == InstanceState.READY.value,
            Instance.observed_digest == version.digest,
        )
    ).one()


def canary_restarts(session: Session, rollout: Rollout) -> int:
    """Restarts of the canary version's instances so far (summed restart counters)."""
    total = session.exec(
        select(func.coalesce(func.sum(Instance.restart_count), 0)).where(
            Instance.deployment_id == rollout.deployment_id,
            Instance.version_id == rollout.to_version_id,
        )
    ).one()
    return int(total)


def subject(deployment: Deployment) -> str:
    """The events' subject."""
    return f"deployment/{deployment.name}"


def set_canary(
    session: Session,
    now: datetime,
    actor: str,
    rollout: Rollout,
    deployment: Deployment,
    *,
    instances: int | None = None,
    weight: int | None = None,
) -> None:
    """Change the canary's instances and/or weight; re-plans when the instances change."""
    replan = instances is not None and instances != rollout.canary_instances
    if instances is not None:
        rollout.canary_instances = instances
    if weight is not None:
        rollout.canary_weight = weight
    rollout.updated_at = now
    session.add(rollout)
    session.flush()
    if replan:
        replan_deployment(session, now, actor, deployment)


def end(
    session: Session,
    now: datetime,
    actor: str,
    rollout: Rollout,
    deployment: Deployment,
    state: RolloutState,
    reason: str,
) -> None:
    """Abort (or roll back) an active rollout: canary weight 0 at once, its instances back on
    the stable version (kept on the hosts: nothing to download)."""
    rollout.state = state
    rollout.message = reason[:1000]
    rollout.phase = RolloutPhase.ENDING
    set_canary(session, now, actor, rollout, deployment, instances=0, weight=0)
    record_event(
        session,
        now,
        actor,
        f"{rollout.kind}.{state}",
        subject(deployment),
        f"{rollout.kind} {rollout.id} of deployment {deployment.name} {state.replace('_', ' ')}: "
        f"{reason}",
        rollout=rollout.id,
        reason=reason,
    )


def pause(session: Session, now: datetime, actor: str, rollout: Rollout, reason: str) -> None:
    """Stop the step's clock where it is; the canary keeps its weight."""
    if rollout.step_started_at is not None:
        left = interval_of(rollout) - (now - rollout.step_started_at)
        rollout.paused_left_s = max(left.total_seconds(), 0.0)
    rollout.state = RolloutState.PAUSED
    rollout.message = reason or "paused by hand"
    rollout.updated_at = now
    session.add(rollout)


def resume(session: Session, now: datetime, rollout: Rollout) -> None:
    """Restart the step's clock with the time that was left."""
    if rollout.paused_left_s is not None:
        rollout.step_started_at = now - (
            interval_of(rollout) - timedelta(seconds=rollout.paused_left_s)
        )
    rollout.paused_left_s = None
    rollout.state = RolloutState.PROGRESSING
    rollout.message = "resumed"
    rollout.ticked_at = now
    rollout.updated_at = now
    session.add(rollout)


def is_active(rollout: Rollout) -> bool:
    """Progressing or paused."""
    return rollout.state in ACTIVE_STATES


def active_of(session: Session, deployment_id: int) -> Rollout | None:
    """The deployment's active rollout, rollback or restart, if any."""
    return session.exec(
        select(Rollout)
        .where(Rollout.deployment_id == deployment_id, col(Rollout.state).in_(ACTIVE_STATES))
        .order_by(col(Rollout.id).desc())
    ).first()


def staging_hosts(session: Session, deployment: Deployment) -> list[Host]:
    """The hosts a rollout of DEPLOYMENT pre-stages on: those its instances run on."""
    on = select(Instance.host_id).where(Instance.deployment_id == deployment.id)
    return list(session.exec(select(Host).where(col(Host.id).in_(on)).order_by(col(Host.name))))


def staged(host: Host, digest: str) -> tuple[str, str]:
    """(ready | failed | fetching, error) of snapshot DIGEST on HOST, from its agent's facts."""
    facts = host.facts or {}
    if digest in facts.get("snapshots", []):
        return "ready", ""
    for failure in facts.get("snapshot_failures", []):
        if failure.get("digest") == digest:
            return "failed", str(failure.get("error", ""))
    return "fetching", ""


def stage_hosts(session: Session, rollout: Rollout, deployment: Deployment) -> None:
    """Tell the deployment's hosts about the rollout (their next heartbeat carries the version
    to fetch ahead of time)."""
    bump_generation(session, [h.id for h in staging_hosts(session, deployment) if h.id])
