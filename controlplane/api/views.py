"""Rows -> API bodies (`protocol.rest`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlmodel import Session, col, select

from controlplane.models import ApiToken, Deployment, Host, Instance, Model, ModelVersion
from controlplane.planner.fit import engine_settings
from controlplane.services.canary import Canary
from controlplane.services.placement import active_rollouts
from protocol.autoscale import AutoscaleStatus
from protocol.gateway import CanaryOut
from protocol.rest import (
    DeploymentOut,
    HostOut,
    InstanceOut,
    ModelOut,
    Placement,
    TokenOut,
    VersionOut,
)
from protocol.rollout_policy import RolloutPolicy
from protocol.version_ref import VersionRef
from protocol.wire import STORED, ExitInfo, GpuStatus, HostFacts, Manifest, MemoryPlan


def instances_out(session: Session, *where: Any) -> list[InstanceOut]:
    """Instances matching `where`, with their deployment, host and version names (one query).

    Never their API keys: those go to the instance's own agent (and gateways) only.
    """
    rows = session.exec(
        select(Instance, Deployment.name, Host, ModelVersion)
        .join(Deployment, col(Deployment.id) == col(Instance.deployment_id))
        .join(Host, col(Host.id) == col(Instance.host_id))
        .join(ModelVersion, col(ModelVersion.id) == col(Instance.version_id))
        .where(*where)
        .order_by(col(Instance.id))
    ).all()
    return [
        InstanceOut(
            id=inst.id or 0,
            deployment=dep,
            host=host.name,
            version=version.version,
            port=inst.port,
            gpu_indices=list(inst.gpu_indices),
            desired_state=inst.desired_state,
            observed_state=inst.observed_state,
            pid=inst.pid,
            restart_count=inst.restart_count,
            last_exit=ExitInfo.model_validate(inst.last_exit, context=STORED)
            if inst.last_exit
            else None,
            message=inst.message,
            observed_at=inst.observed_at,
            observed_digest=inst.observed_digest,
            on_version=inst.observed_digest == version.digest
            and host.applied_generation >= inst.spec_generation,
            standby=inst.standby,
            retiring=inst.retire_at is not None,
            requests_running=inst.requests_running,
            requests_waiting=inst.requests_waiting,
        )
        for inst, dep, host, version in rows
    ]


def host_out(
    host: Host, instances: list[InstanceOut] | None = None, agent_token: bool | None = None
) -> HostOut:
    """A host with its facts and latest GPU samples."""
    return HostOut(
        id=host.id or 0,
        name=host.name,
        state=host.state,
        draining=host.draining,
        labels=host.labels,
        reported_labels=host.reported_labels,
        advertise_address=host.advertise_address,
        agent_token=agent_token,
        registered_at=host.registered_at,
        last_seen_at=host.last_seen_at,
        heartbeat_interval_s=host.heartbeat_interval_s,
        port_range=(host.port_range_start, host.port_range_end),
        # Rows an agent wrote before control characters were refused are shown, not failed.
        facts=HostFacts.model_validate(host.facts, context=STORED) if host.facts else None,
        gpus=[GpuStatus.model_validate(g, context=STORED) for g in host.gpu_samples],
        desired_generation=host.desired_generation,
        applied_generation=host.applied_generation,
        instances=instances,
    )


def version_out(
    version: ModelVersion, model_name: str, parent: str | None, *, with_manifest: bool
) -> VersionOut:
    """A model version; the (possibly long) manifest only when asked for."""
    return VersionOut(
        model=model_name,
        version=version.version,
        line=version.line,
        parent=parent,
        digest=version.digest,
        total_bytes=version.total_bytes,
        file_count=len(version.manifest),
        memory_plan=MemoryPlan(**version.memory_plan) if version.memory_plan else None,
        source_uri=version.source_uri,
        notes=version.notes,
        deprecated=version.deprecated,
        created_at=version.created_at,
        manifest=Manifest(files=version.manifest) if with_manifest else None,
    )


def parent_refs(session: Session, versions: list[ModelVersion]) -> dict[int, str]:
    """`NAME:VERSION` of every parent of these versions, by parent id."""
    ids = {v.parent_id for v in versions if v.parent_id is not None}
    if not ids:
        return {}
    rows = session.exec(
        select(ModelVersion.id, Model.name, ModelVersion.version)
        .join(Model, col(Model.id) == col(ModelVersion.model_id))
        .where(col(ModelVersion.id).in_(ids))
    ).all()
    return {vid: str(VersionRef(name, tag)) for vid, name, tag in rows if vid is not None}


def model_out(session: Session, model: Model) -> ModelOut:
    """A model with all its versions (no manifests)."""
    return models_out(session, [model])[0]


def models_out(session: Session, models: Sequence[Model]) -> list[ModelOut]:
    """Models with all their versions (no manifests), in two queries for any count."""
    if not models:
        return []
    ids = [m.id for m in models]
    versions = list(
        session.exec(
            select(ModelVersion)
            .where(col(ModelVersion.model_id).in_(ids))
            .order_by(col(ModelVersion.id))
        ).all()
    )
    parents = parent_refs(session, versions)
    by_model: dict[int | None, list[ModelVersion]] = {}
    for v in versions:
        by_model.setdefault(v.model_id, []).append(v)
    return [
        ModelOut(
            name=m.name,
            created_at=m.created_at,
            versions=[
                version_out(v, m.name, parents.get(v.parent_id or -1), with_manifest=False)
                for v in by_model.get(m.id, [])
            ],
        )
        for m in models
    ]


def deployments_out(
    session: Session, deployments: Sequence[Deployment], *, admin: bool
) -> list[DeploymentOut]:
    """Deployments with their model, stable version, instances and canary (four queries for any
    count); the rollout policy's `notify` URL whole for an ADMIN only."""
    ids = [d.id for d in deployments]
    names = {
        dep_id: (model, version)
        for dep_id, model, version in session.exec(
            select(Deployment.id, Model.name, ModelVersion.version)
            .join(Model, col(Model.id) == col(Deployment.model_id))
            .join(ModelVersion, col(ModelVersion.id) == col(Deployment.stable_version_id))
            .where(col(Deployment.id).in_(ids))
        ).all()
    }
    instances: dict[str, list[InstanceOut]] = {}  # by deployment name (names are unique)
    for inst in instances_out(session, col(Instance.deployment_id).in_(ids)):
        instances.setdefault(inst.deployment, []).append(inst)
    rollouts = active_rollouts(session, [i for i in ids if i is not None])
    tags = dict(
        session.exec(
            select(ModelVersion.id, ModelVersion.version).where(
                col(ModelVersion.id).in_(
                    {r.to_version_id for r in rollouts.values()}
                    | {d.rollback_version_id for d in deployments if d.rollback_version_id}
                )
            )
        ).all()
    )
    canaries = {dep: (tags.get(r.to_version_id), r.canary_weight) for dep, r in rollouts.items()}
    return [
        DeploymentOut(
            id=d.id or 0,
            name=d.name,
            model=names.get(d.id, ("", ""))[0],
            version=names.get(d.id, ("", ""))[1],
            placement=Placement.model_validate(
                {"hosts": d.placement_hosts, "labels": d.placement_labels}, context=STORED
            ),
            instances_per_host=d.instances_per_host,
            gpus_per_instance=d.gpus_per_instance,
            engine_config=d.engine_config,
            created_at=d.created_at,
            updated_at=d.updated_at,
            instances=instances.get(d.name, []),
            canary_version=canaries.get(d.id or 0, (None, 0))[0],
            canary_weight=canaries.get(d.id or 0, (None, 0))[1],
            # A deleted version (no FK on purpose) reads as nothing to go back to.
            rollback_version=tags.get(d.rollback_version_id) if d.rollback_version_id else None,
            rollout_policy=RolloutPolicy.model_validate(d.rollout_policy)
            if admin
            else RolloutPolicy.model_validate(d.rollout_policy).masked(),
            autoscale=d.autoscale,
            autoscale_status=autoscale_status(d, instances.get(d.name, [])),
        )
        for d in deployments
    ]


def autoscale_status(
    deployment: Deployment, instances: list[InstanceOut]
) -> AutoscaleStatus | None:
    """Where an autoscaled deployment stands (None: it does not autoscale)."""
    policy = deployment.autoscale
    if policy is None:
        return None
    replicas = deployment.replicas or 0
    live = [i for i in instances if not i.retiring]
    serving = [i for i in live if not i.standby]
    ready = [i for i in serving if i.observed_state == "ready" and i.on_version]
    running = sum(i.requests_running or 0 for i in ready)
    waiting = sum(i.requests_waiting or 0 for i in ready)
    max_concurrent = engine_settings(deployment.engine_config).service.max_concurrent_requests
    state = deployment.autoscale_state
    return AutoscaleStatus(
        replicas=replicas,
        standby=policy.standby_beside(replicas),
        serving_ready=len(ready),
        standby_ready=sum(1 for i in live if i.standby and i.observed_state == "ready"),
        placed=len(live),
        queue_per_instance=round(waiting / len(ready), 3) if ready else None,
        utilization=round(running / (len(ready) * max(1, max_concurrent)), 3) if ready else None,
        pinned_at_max_since=state.pinned_at_max_since,
        starved_since=state.starved_since,
        starved_reason=state.starved_reason,
        last_decision=state.last_decision,
    )


def canary_out(canary: Canary) -> CanaryOut:
    """A deployment's canary after a change (weight and instances 0 once it ended)."""
    rollout = canary.rollout
    return CanaryOut(
        deployment=canary.deployment.name,
        stable=canary.stable,
        canary=canary.canary,
        weight=rollout.canary_weight,
        instances=rollout.canary_instances,
        state=rollout.state,
    )


def token_out(row: ApiToken, host: str | None) -> TokenOut:
    """A token without its secret."""
    return TokenOut(
        id=row.key_id,
        name=row.name,
        role=row.role,
        host=host,
        expires_at=row.expires_at,
        uses_left=row.uses_left,
        created_at=row.created_at,
        created_by=row.created_by,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
        deployments=row.deployments,
        allow_pool_pin=row.allow_pool_pin,
        max_concurrency=row.max_concurrency,
        labels=row.labels,
    )
