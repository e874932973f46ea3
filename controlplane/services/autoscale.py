"""Autoscaling, the operator's side and the store's: set or clear a deployment's policy, wake one
scaled to zero, and apply a count the autoscaler chose (`controlplane.autoscaler`).

A scale-down never stops an instance in the middle of a request: the instances it gives up are
first taken out of the gateway's pools (`Instance.retire_at` set), and only once every gateway
has polled the routes since (`RETIRE_DRAIN_S`) are they deleted, which has their agent drain
them (SIGTERM: the engine finishes what it runs, then exits).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.models import Deployment, Instance
from controlplane.planner import Plan
from controlplane.rollouts import store as rollout_store
from controlplane.services.deployments import get_deployment
from controlplane.services.errors import Invalid
from controlplane.services.placement import (
    active_rollouts,
    place_deployment,
    replan_deployment,
)
from protocol.autoscale import AutoscaleDecision, AutoscalePolicy
from protocol.wire import DesiredInstanceState, InstanceState

# Gateways poll the routes every second by default: three polls and a margin before a retiring
# instance is stopped, so none of them still sends it a request when it begins to drain.
RETIRE_DRAIN_S = 4.0


def serving(instances: Sequence[Instance]) -> list[Instance]:
    """The instances that are (or will be) in the pools: neither standby nor retiring."""
    return [i for i in instances if not i.standby and i.retire_at is None]


def is_ready(instance: Instance) -> bool:
    """Ready and meant to run (the pools also ask for a current host: the routes check that)."""
    return (
        instance.observed_state == InstanceState.READY.value
        and instance.desired_state == DesiredInstanceState.RUNNING.value
    )


def instances_of(session: Session, deployment_id: int) -> list[Instance]:
    """The deployment's instances, oldest first."""
    query = select(Instance).where(Instance.deployment_id == deployment_id)
    return list(session.exec(query.order_by(col(Instance.id))).all())


def set_policy(
    session: Session, now: datetime, actor: str, name: str, policy: AutoscalePolicy
) -> Deployment:
    """Autoscale deployment NAME within POLICY (a new one replaces the old). It starts from the
    serving instances it has, moved inside the bounds; where those do not fit, nothing changes
    and the error says why."""
    deployment = get_deployment(session, name)
    assert deployment.id is not None
    current = deployment.replicas
    if current is None:
        current = len(serving(instances_of(session, deployment.id)))
    deployment.autoscale = policy
    deployment.replicas = min(max(current, policy.min), policy.max)
    deployment.updated_at = now
    session.add(deployment)
    session.flush()
    place_deployment(session, now, deployment)
    record_event(
        session,
        now,
        actor,
        "autoscale.set",
        f"deployment/{name}",
        f"deployment {name} autoscales {policy.min}..{policy.max} from {deployment.replicas} "
        f"instance(s), {policy.standby} standby",
        policy=policy.model_dump(mode="json"),
        replicas=deployment.replicas,
    )
    return deployment


def clear_policy(session: Session, now: datetime, actor: str, name: str) -> Deployment:
    """Stop autoscaling NAME: it keeps the count of serving instances it has (a fixed count,
    until `instances_per_host` is set again); its standby instances stop."""
    deployment = get_deployment(session, name)
    if deployment.autoscale is None:
        raise Invalid(f"deployment {name} does not autoscale: nothing to turn off")
    assert deployment.id is not None
    for instance in instances_of(session, deployment.id):
        if instance.standby and instance.retire_at is None:
            instance.retire_at = now  # out of the pools already: nothing to drain
            session.add(instance)
    deployment.autoscale = None
    deployment.updated_at = now
    session.add(deployment)
    session.flush()
    replan_deployment(session, now, actor, deployment)
    record_event(
        session,
        now,
        actor,
        "autoscale.off",
        f"deployment/{name}",
        f"deployment {name} no longer autoscales: it keeps {deployment.replicas} instance(s)",
        replicas=deployment.replicas,
    )
    return deployment


def request_wake(session: Session, now: datetime, name: str) -> bool:
    """A gateway holds a request for NAME: ask the autoscaler for an instance. True when the
    deployment is scaled to zero (the autoscaler will start one), False when it has instances
    (or does not autoscale: the gateway then answers as it always did)."""
    deployment = get_deployment(session, name)
    if deployment.autoscale is None or deployment.replicas != 0:
        return False
    if deployment.wake_requested_at is None or deployment.wake_requested_at < now:
        deployment.wake_requested_at = now
        session.add(deployment)
    return True


def choose_victims(
    instances: Sequence[Instance], count: int, canary_version_id: int | None, canary_drop: int
) -> list[Instance]:
    """COUNT serving instances to retire: CANARY_DROP of them of the canary version (so a
    rollout keeps its share), then the others; among each, those not ready first, then the
    least busy, then the newest."""

    def order(i: Instance) -> tuple[bool, int, int]:
        return (is_ready(i), i.requests_running or 0, -(i.id or 0))

    pool = sorted(serving(instances), key=order)
    canary = [i for i in pool if i.version_id == canary_version_id]
    chosen = canary[: max(0, min(canary_drop, count))]
    rest = [i for i in pool if i not in chosen]
    return chosen + rest[: count - len(chosen)]


def apply_count(
    session: Session,
    now: datetime,
    deployment: Deployment,
    decision: AutoscaleDecision,
) -> Plan:
    """Set the deployment's serving count to DECISION's, retiring what it gives up, keep an
    active canary's share, and place it (what does not fit is placed by a later round)."""
    assert deployment.id is not None
    instances = instances_of(session, deployment.id)
    target, before = decision.to_replicas, decision.from_replicas
    rollout = active_rollouts(session, [deployment.id]).get(deployment.id)
    canary_id = rollout.to_version_id if rollout is not None else None
    canary_now = sum(1 for i in serving(instances) if i.version_id == canary_id)
    canary_after = rollout_store.rescale_canary(session, rollout, target) if rollout else 0
    drop = len(serving(instances)) - target
    retire_at = now + timedelta(seconds=RETIRE_DRAIN_S)
    victims = choose_victims(instances, max(drop, 0), canary_id, canary_now - canary_after)
    if target == 0:
        # Scaled to zero: no standby either.
        victims += [i for i in instances if i.standby and i.retire_at is None]
    for instance in victims:
        instance.retire_at = now if instance.standby else retire_at
        session.add(instance)
    deployment.replicas = target
    deployment.updated_at = now
    if decision.action == "wake":
        deployment.wake_requested_at = None
    session.add(deployment)
    session.flush()
    plan = replan_deployment(session, now, "autoscaler", deployment)
    record_event(
        session,
        now,
        "autoscaler",
        f"autoscale.{decision.action}",
        f"deployment/{deployment.name}",
        f"deployment {deployment.name}: {before} -> {target} instance(s): {decision.reason}",
        **{
            "from": before,
            "to": target,
            "retired": [i.id for i in victims],
            "figures": decision.figures,
        },
    )
    return plan
