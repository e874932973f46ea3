"""Manual canaries (`PUT`/`DELETE /api/v1/deployments/{name}/canary`, `dctl deploy canary`):
another version of a deployment's model on some of its instances, at a weight the operator sets.

A manual canary is a rollout record of kind `manual`: the rollout machine holds it where the
operator puts it (no timed plan, no analysis) and its store writes it, as for every other kind;
this module only checks the request and names the versions. Every change re-plans the
deployment, so the agents get the new versions with their next heartbeat, and records an Event.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlmodel import Session, select

from controlplane.models import Deployment, Model, Rollout
from controlplane.rollouts import store
from controlplane.rollouts.messages import RollBack, SetManual, Start
from controlplane.rollouts.progress import RolloutSettings
from controlplane.services.errors import Conflict, Invalid, NotFound
from controlplane.services.models import find_version
from controlplane.services.placement import active_rollouts
from protocol.gateway import CanarySet
from protocol.rollout_states import RolloutKind, RolloutPhase
from protocol.version_ref import VersionRef


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
    label = str(VersionRef(model.name, version.version))
    if version.id == deployment.stable_version_id:
        raise Conflict(
            f"{label} is the stable version of deployment {name}: a canary runs another version"
        )
    rollout = active_rollouts(session, [deployment.id]).get(deployment.id)
    if rollout is not None and rollout.to_version_id != version.id:
        running = store.label(session, rollout.to_version_id)
        raise Conflict(
            f"deployment {name} already has a canary of {running}: end it first "
            f"(DELETE /api/v1/deployments/{name}/canary), then start one of {label}"
        )
    if rollout is None and version.deprecated:
        # As for deployments (`deployable_version`): a deprecated version starts nowhere new.
        raise Invalid(f"{label} is deprecated: deploy a newer version")
    total = store.instance_total(session, deployment.id)
    if spec.instances >= total:
        raise Invalid(
            f"deployment {name} runs {total} instance(s); a canary may take at most "
            f"{max(total - 1, 0)}, so that the stable version keeps serving: scale the deployment "
            "up (instances_per_host or placement) first"
        )
    if rollout is None:
        rollout = store.create(
            session,
            now,
            actor,
            deployment,
            kind=RolloutKind.MANUAL,
            to_version_id=version.id,
            phase=RolloutPhase.WAITING,
            weights=[],
            settings=RolloutSettings(),
            reason="set by hand",
        )
        store.command(session, now, actor, rollout, Start())
    store.command(session, now, actor, rollout, SetManual(spec.weight, spec.instances))
    return Canary(deployment, rollout, store.label(session, deployment.stable_version_id), label)


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
    label = store.label(session, rollout.to_version_id)
    store.command(session, now, actor, rollout, RollBack("ended by hand"))
    return Canary(deployment, rollout, store.label(session, deployment.stable_version_id), label)


def locked_deployment(session: Session, name: str) -> Deployment:
    """The deployment, its row locked until commit (PostgreSQL; SQLite has one writer anyway),
    so two requests cannot both start a canary or rollout of it."""
    row = session.exec(select(Deployment).where(Deployment.name == name).with_for_update()).first()
    if row is None:
        raise NotFound(f"deployment {name!r}")
    return row
