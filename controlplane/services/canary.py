"""Canaries: another version of a deployment's model on some of its instances, at a weight.

A canary is an active `Rollout` row (`protocol.rollouts.ACTIVE_STATES`): `to_version_id` runs on
`canary_instances` of the deployment's instances (the planner picks which, see
`controlplane.planner`) and gateways send it `canary_weight` percent of the requests. An operator
sets one by hand today (`PUT /api/v1/deployments/{name}/canary`); the rollout controller will
call the same functions. Every change re-plans the deployment, so the agents get the new
versions with their next heartbeat, and records an Event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlmodel import Session, func, select

from controlplane.eventlog import record_event
from controlplane.models import Deployment, Instance, Model, Rollout
from controlplane.services.errors import Conflict, Invalid, NotFound
from controlplane.services.models import find_version
from controlplane.services.placement import (
    active_rollouts,
    load_versions,
    place_deployment,
    replan_deployment,
)
from protocol.gateway import CanarySet
from protocol.rollouts import RolloutKind, RolloutState


@dataclass(frozen=True)
class Canary:
    """A deployment's rollout as it stands after a change, with its versions' names."""

    deployment: Deployment
    rollout: Rollout
    stable: str  # MODEL:VERSION
    canary: str  # MODEL:VERSION


def set_canary(session: Session, now: datetime, actor: str, name: str, spec: CanarySet) -> Canary:
    """Start a canary of `spec.version` on `spec.instances` instances at `spec.weight` percent,
    or change the weight and instances of the one running.

    NotFound: no such deployment or version. Conflict: the version is the stable one, or another
    canary is active (end it first). Invalid: the version is deprecated, the canary would take
    every instance, or its instances do not fit where they land (nothing is written then).
    """
    deployment = locked_deployment(session, name)
    assert deployment.id is not None
    model = session.get(Model, deployment.model_id)
    assert model is not None
    found = find_version(session, model.name, spec.version)
    if found is None:
        raise NotFound(f"version {spec.version!r} of model {model.name!r}")
    version = found[1]
    assert version.id is not None
    label = f"{model.name}:{version.version}"
    if version.id == deployment.stable_version_id:
        raise Conflict(
            f"{label} is the stable version of deployment {name}: a canary runs another version"
        )
    rollout = active_rollouts(session, [deployment.id]).get(deployment.id)
    if rollout is not None and rollout.to_version_id != version.id:
        running = _label(session, rollout.to_version_id)
        raise Conflict(
            f"deployment {name} already has a canary of {running}: end it first "
            f"(DELETE /api/v1/deployments/{name}/canary), then start one of {label}"
        )
    if rollout is None and version.deprecated:
        # As for deployments (`deployable_version`): a deprecated version starts nowhere new.
        raise Invalid(f"{label} is deprecated: deploy a newer version")
    total = _instance_count(session, deployment.id)
    if spec.instances >= total:
        raise Invalid(
            f"deployment {name} runs {total} instance(s); a canary may take at most "
            f"{max(total - 1, 0)}, so that the stable version keeps serving: scale the deployment "
            "up (instances_per_host or placement) first"
        )
    step = {"weight": spec.weight, "instances": spec.instances, "manual": True}
    if rollout is None:
        rollout = Rollout(
            deployment_id=deployment.id,
            from_version_id=deployment.stable_version_id,
            to_version_id=version.id,
            kind=RolloutKind.MANUAL,
            state=RolloutState.PROGRESSING,
            step_index=0,
            canary_weight=spec.weight,
            canary_instances=spec.instances,
            steps=[step],
            message="set by hand",
            created_at=now,
            updated_at=now,
        )
        kind, verb = "canary.started", "started"
    elif (rollout.canary_weight, rollout.canary_instances) == (spec.weight, spec.instances):
        return Canary(deployment, rollout, _label(session, deployment.stable_version_id), label)
    else:
        # A new list, so the JSON column is seen to change.
        rollout.steps = [*rollout.steps, step]
        rollout.step_index = len(rollout.steps) - 1
        rollout.canary_weight = spec.weight
        rollout.canary_instances = spec.instances
        rollout.updated_at = now
        kind, verb = "canary.updated", "changed"
    session.add(rollout)
    session.flush()
    place_deployment(session, now, deployment)
    record_event(
        session,
        now,
        actor,
        kind,
        f"deployment/{name}",
        f"canary {label} of deployment {name} {verb}: {spec.weight}% of requests, "
        f"{spec.instances} instance(s)",
        version=label,
        weight=spec.weight,
        instances=spec.instances,
    )
    return Canary(deployment, rollout, _label(session, deployment.stable_version_id), label)


def clear_canary(session: Session, now: datetime, actor: str, name: str) -> Canary:
    """End the deployment's canary: rolled back, its instances run the stable version again.

    NotFound when none is active. Never refused for want of room: what does not fit back now
    is placed later (an event says so).
    """
    deployment = locked_deployment(session, name)
    assert deployment.id is not None
    rollout = active_rollouts(session, [deployment.id]).get(deployment.id)
    if rollout is None:
        raise NotFound(f"active canary of deployment {name!r}")
    label = _label(session, rollout.to_version_id)
    rollout.state = RolloutState.ROLLED_BACK
    rollout.canary_weight = 0
    rollout.canary_instances = 0
    rollout.message = "ended by hand"
    rollout.updated_at = now
    session.add(rollout)
    session.flush()
    replan_deployment(session, now, actor, deployment)
    record_event(
        session,
        now,
        actor,
        "canary.ended",
        f"deployment/{name}",
        f"canary {label} of deployment {name} ended: its instances run the stable version again",
        version=label,
    )
    return Canary(deployment, rollout, _label(session, deployment.stable_version_id), label)


def locked_deployment(session: Session, name: str) -> Deployment:
    """The deployment, its row locked until commit (PostgreSQL; SQLite has one writer anyway),
    so two requests cannot both start a canary or rollout of it."""
    row = session.exec(select(Deployment).where(Deployment.name == name).with_for_update()).first()
    if row is None:
        raise NotFound(f"deployment {name!r}")
    return row


def _instance_count(session: Session, deployment_id: int) -> int:
    return session.exec(
        select(func.count()).select_from(Instance).where(Instance.deployment_id == deployment_id)
    ).one()


def _label(session: Session, version_id: int) -> str:
    """MODEL:VERSION of a version id."""
    return load_versions(session, [version_id])[version_id].label
