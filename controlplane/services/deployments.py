"""Deployments: a model version placed on hosts, N instances per host, each on its own GPUs."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete
from sqlmodel import Session, col, select

from controlplane.eventlog import record_event
from controlplane.models import Deployment, Host, Instance, Model, ModelVersion
from controlplane.rollouts.webhook import check_target
from controlplane.services.errors import Conflict, Invalid, NotFound
from controlplane.services.models import deployable_version
from controlplane.services.placement import active_rollouts, bump_generation, place_deployment
from protocol.engine_config import (
    DeploymentEngineConfig,
    ServeConfigError,
    validate_deployment_config,
)
from protocol.parallel_split import parallel_split_problem
from protocol.rest import DeploymentCreate, DeploymentUpdate, Placement
from protocol.version_ref import VersionRef
from protocol.wire import MemoryPlan


def list_deployments(session: Session) -> list[Deployment]:
    """Every deployment, by name."""
    return list(session.exec(select(Deployment).order_by(col(Deployment.name))).all())


def get_deployment(session: Session, name: str) -> Deployment:
    """The deployment called `name`, or NotFound."""
    row = session.exec(select(Deployment).where(Deployment.name == name)).first()
    if row is None:
        raise NotFound(f"deployment {name!r}")
    return row


def create_deployment(
    session: Session, now: datetime, actor: str, spec: DeploymentCreate
) -> Deployment:
    """Create a deployment and place its instances; refused whole when they do not fit."""
    if session.exec(select(Deployment.id).where(Deployment.name == spec.name)).first():
        raise Conflict(f"deployment {spec.name!r} already exists: update or delete it")
    model, version = deployable_version(session, spec.model, spec.version)
    _check_placement(session, spec.placement)
    assert model.id is not None and version.id is not None
    deployment = Deployment(
        name=spec.name,
        model_id=model.id,
        stable_version_id=version.id,
        engine_config=checked_engine_config(spec.engine_config),
        placement_hosts=list(spec.placement.hosts),
        placement_labels=dict(spec.placement.labels),
        instances_per_host=spec.instances_per_host,
        gpus_per_instance=spec.gpus_per_instance or None,
        autoscale=spec.autoscale,
        # Autoscaled: it starts at its min, but with one instance at least, so that the model is
        # seen to load (a min of 0 then idles down to zero).
        replicas=max(spec.autoscale.min, 1) if spec.autoscale is not None else None,
        created_at=now,
        updated_at=now,
    )
    check_parallel(deployment, VersionRef(spec.model, spec.version), version)
    session.add(deployment)
    session.flush()
    place_deployment(session, now, deployment)
    record_event(
        session,
        now,
        actor,
        "deployment.created",
        f"deployment/{spec.name}",
        f"deployment {spec.name} created: {VersionRef(spec.model, spec.version)}, "
        + (
            f"autoscaled {spec.autoscale.min}..{spec.autoscale.max} from {deployment.replicas}"
            if spec.autoscale is not None
            else f"{spec.instances_per_host} per host"
        ),
        model=spec.model,
        version=spec.version,
        gpus_per_instance=deployment.gpus_per_instance,
    )
    return deployment


def update_deployment(
    session: Session,
    now: datetime,
    actor: str,
    name: str,
    change: DeploymentUpdate,
    notify_allow_private: bool = False,
) -> Deployment:
    """Scale, reconfigure, switch version, GPUs, placement or rollout policy; refused whole when
    it does not fit (a `notify` URL to a private address: `[controlplane] notify_allow_private`).
    A switch of version keeps the one it replaces (and its config) as the rollback target, as a
    promotion does."""
    if change.rollout_policy is not None:
        check_target(change.rollout_policy.notify, "rollout_policy.notify", notify_allow_private)
    deployment = get_deployment(session, name)
    old_version, old_config = deployment.stable_version_id, deployment.engine_config
    changes: dict[str, Any] = {}
    if change.instances_per_host is not None:
        if deployment.autoscale is not None:
            raise Conflict(
                f"deployment {name} autoscales ({deployment.autoscale.min}.."
                f"{deployment.autoscale.max}): change its bounds with `dctl deploy autoscale "
                f"{name} --min N --max M`, or turn it off (--off) to set instances per host"
            )
        deployment.instances_per_host = change.instances_per_host
        deployment.replicas = None  # a count per host again, not one for the deployment
        changes["instances_per_host"] = change.instances_per_host
    if change.gpus_per_instance is not None:
        deployment.gpus_per_instance = change.gpus_per_instance or None
        changes["gpus_per_instance"] = deployment.gpus_per_instance
    if change.engine_config is not None:
        deployment.engine_config = checked_engine_config(change.engine_config)
        changes["engine_config"] = True
    if change.version is not None:
        model = session.get(Model, deployment.model_id)
        assert model is not None
        _model, version = deployable_version(session, model.name, change.version)
        assert version.id is not None
        moves = version.id != deployment.stable_version_id
        if moves and deployment.id in active_rollouts(session, [deployment.id or 0]):
            # Promoting or abandoning the canary is the rollout's to decide, not a PATCH's.
            raise Conflict(
                f"deployment {name} has an active canary: end it first "
                f"(DELETE /api/v1/deployments/{name}/canary), then change the version"
            )
        if moves:
            # As a promotion does: what it replaced is what `dctl rollback` goes back to.
            deployment.rollback_version_id = old_version
            deployment.rollback_engine_config = old_config
        deployment.stable_version_id = version.id
        changes["version"] = change.version
    if change.rollout_policy is not None:
        # Only what the file sets: the built-in defaults fill the rest at each rollout.
        deployment.rollout_policy = change.rollout_policy.model_dump(exclude_none=True)
        # Viewers read the event log: the notify URL as they may see it.
        changes["rollout_policy"] = change.rollout_policy.masked().model_dump(exclude_none=True)
    if change.placement is not None:
        _check_placement(session, change.placement)
        deployment.placement_hosts = list(change.placement.hosts)
        deployment.placement_labels = dict(change.placement.labels)
        changes["placement"] = change.placement.model_dump()
    if not changes:
        raise Invalid(
            "nothing to update: give instances_per_host, gpus_per_instance, engine_config, "
            "version, placement or rollout_policy"
        )
    if changes.keys() & {"gpus_per_instance", "engine_config", "version"}:
        model = session.get(Model, deployment.model_id)
        stable = session.get(ModelVersion, deployment.stable_version_id)
        assert model is not None and stable is not None
        check_parallel(deployment, VersionRef(model.name, stable.version), stable)
    deployment.updated_at = now
    session.add(deployment)
    session.flush()
    place_deployment(session, now, deployment)
    if change.engine_config is not None or deployment.stable_version_id != old_version:
        # A new config reaches every host of the deployment even when no instance row changed,
        # and a new stable version changes every host's keep-list (the rollback target).
        hosts = session.exec(
            select(Instance.host_id).where(Instance.deployment_id == deployment.id)
        ).all()
        bump_generation(session, hosts)
    record_event(
        session,
        now,
        actor,
        "deployment.updated",
        f"deployment/{name}",
        f"deployment {name} updated: {', '.join(changes)}",
        **changes,
    )
    return deployment


def delete_deployment(session: Session, now: datetime, actor: str, name: str) -> None:
    """Delete a deployment; its agents stop its instances."""
    deployment = get_deployment(session, name)
    hosts = session.exec(
        select(Instance.host_id).where(Instance.deployment_id == deployment.id)
    ).all()
    session.execute(delete(Instance).where(col(Instance.deployment_id) == deployment.id))
    session.delete(deployment)
    bump_generation(session, hosts)
    record_event(
        session,
        now,
        actor,
        "deployment.deleted",
        f"deployment/{name}",
        f"deployment {name} deleted",
    )


def checked_engine_config(data: dict[str, Any]) -> dict[str, Any]:
    """The engine config normalised to the keys it sets, or Invalid naming the bad key (a
    deployment's and a rollout's take the same check)."""
    try:
        return validate_deployment_config(data)
    except ServeConfigError as exc:
        raise Invalid(str(exc)) from None


def check_parallel(
    deployment: Deployment,
    label: VersionRef,
    version: ModelVersion,
    engine_config: dict[str, Any] | None = None,
) -> None:
    """Invalid when the deployment's instances could not start their ranks: a `parallel.size`
    other than its GPUs per instance (each GPU runs one rank), or a version whose heads or
    experts do not split over them (`parallel_split_problem`, where its memory plan has them).

    On CPUs (`resources.device: cpu`) ranks are processes and any size goes; with GPUs per
    instance left to the host (all its GPUs), the planner holds the size to each host's count.
    """
    # Stored configs went through `checked_engine_config`: this parses, with the defaults.
    # ENGINE_CONFIG: the one a rollout brings instead of the deployment's.
    chosen = deployment.engine_config if engine_config is None else engine_config
    settings = DeploymentEngineConfig.model_validate(chosen)
    if settings.engine.kind != "dctl":
        return  # vLLM, SGLang, a command: they split a model over its GPUs by their own rules
    size, gpus = settings.parallel.size, deployment.gpus_per_instance
    on_cpu = settings.resources.device == "cpu"
    if settings.gpu_ranks is not None and gpus is not None and settings.gpu_ranks != gpus:
        raise Invalid(
            f"engine_config: parallel.size ({size}) must equal gpus_per_instance ({gpus}): each "
            "GPU of an instance runs one rank. Leave parallel.size out to follow "
            "gpus_per_instance, or give both the same number"
        )
    # Left out: one rank per GPU of the instance (one on a CPU; unknown for all of a host's).
    ranks = size if size is not None else (None if on_cpu else gpus)
    if ranks is None or not version.memory_plan:
        return
    plan = MemoryPlan.model_validate(version.memory_plan)
    problem = parallel_split_problem(
        ranks,
        settings.parallel.experts,
        model=str(label),
        num_heads=plan.num_heads,
        kv_heads=plan.num_kv_heads or (),
        num_experts=plan.num_experts,
    )
    if problem is not None:
        default = "" if size is not None else f" (parallel.size left out: gpus_per_instance {gpus})"
        raise Invalid(f"engine_config: {problem}{default}")


def _check_placement(session: Session, placement: Placement) -> None:
    if not placement.hosts and not placement.labels:
        raise Invalid("placement: name hosts or labels (e.g. {'hosts': ['gpu-1']})")
    known = set(session.exec(select(Host.name).where(col(Host.name).in_(placement.hosts))).all())
    missing = [h for h in placement.hosts if h not in known]
    if missing:
        raise Invalid(f"placement: host(s) {', '.join(missing)} not registered (`dctl host list`)")
