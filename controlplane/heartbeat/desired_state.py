"""A host's desired state as its agent receives it: the wire `DesiredInstance` of each instance.

Read only for the host whose agent asks (the heartbeat is scoped to the token's host), since it
carries the engines' API keys.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlmodel import col

from controlplane.models import Deployment, Instance, Model, Rollout
from controlplane.models import ModelVersion as VersionRow
from protocol.rollout_states import ACTIVE_STATES, RolloutKind, RolloutPhase
from protocol.sources import local_source_dir
from protocol.wire import DesiredInstance, Manifest, MemoryPlan, ModelVersionRef

# Where engines listen when the agent did not say which address other machines reach it on.
DEFAULT_BIND_ADDRESS = "127.0.0.1"


def _version_columns() -> tuple[Any, ...]:
    """What an agent needs of a version to fetch and run it, as columns of a select."""
    return (
        col(Model.name).label("model"),
        col(VersionRow.version),
        col(VersionRow.digest),
        col(VersionRow.line),
        col(VersionRow.manifest),
        col(VersionRow.source_uri),
        col(VersionRow.memory_plan),
    )


def desired_instances(
    conn: Connection, host_id: int, advertise_address: str | None
) -> list[DesiredInstance]:
    """Every instance placed on host `host_id`, in id order, as that host's agent must run it.

    Engines bind to the host's advertise address; weights stored on the control plane's own disk
    are offered under a path of the control plane's API (`files_url`), which the agent joins to the
    control-plane URL it was configured with: never a URL from the request's Host header.
    """
    rows = conn.execute(
        select(
            col(Instance.id),
            col(Instance.port),
            col(Instance.desired_state),
            col(Instance.gpu_indices),
            col(Instance.api_key),
            col(Instance.deployment_id),
            col(Instance.version_id),
            col(Deployment.name).label("deployment"),
            col(Deployment.engine_config),
            *_version_columns(),
        )
        .join(Deployment, col(Deployment.id) == col(Instance.deployment_id))
        .join(VersionRow, col(VersionRow.id) == col(Instance.version_id))
        .join(Model, col(Model.id) == col(VersionRow.model_id))
        .where(col(Instance.host_id) == host_id)
        .order_by(col(Instance.id))
    ).all()
    bind_address = advertise_address or DEFAULT_BIND_ADDRESS
    canary_configs = _canary_configs(conn, {r.deployment_id for r in rows})
    desired = []
    for r in rows:
        desired.append(
            DesiredInstance(
                instance_id=r.id,
                deployment=r.deployment,
                port=r.port,
                # A rollout's canary runs its own engine config, stable the deployment's.
                engine_config=canary_configs.get((r.deployment_id, r.version_id), r.engine_config),
                desired_state=r.desired_state,
                gpu_indices=r.gpu_indices or [],
                bind_address=bind_address,
                # An instance without a key ("") is served without one.
                api_key=r.api_key or None,
                model=_model_ref(r),
            )
        )
    return desired


def _model_ref(r: Any) -> ModelVersionRef:
    """A version row (model, version, digest, line, manifest, source_uri, memory_plan) as the
    agent gets it; weights on the control plane's own disk are offered under `files_url`."""
    files_url = None
    if local_source_dir(r.source_uri) is not None:
        files_url = f"/api/v1/models/{r.model}/versions/{r.version}/files/"
    return ModelVersionRef(
        name=r.model,
        version=r.version,
        digest=r.digest,
        line=r.line,
        manifest=Manifest(files=r.manifest),
        source_uri=r.source_uri,
        files_url=files_url,
        memory_plan=MemoryPlan(**r.memory_plan) if r.memory_plan else None,
    )


def prefetch(conn: Connection, host_id: int) -> list[ModelVersionRef]:
    """Versions host `host_id` fetches ahead of time: those of the rollouts pre-staging on the
    deployments that have an instance there."""
    deployments = select(col(Instance.deployment_id)).where(col(Instance.host_id) == host_id)
    rows = conn.execute(
        select(
            *_version_columns(),
        )
        .select_from(Rollout)
        .join(VersionRow, col(VersionRow.id) == col(Rollout.to_version_id))
        .join(Model, col(Model.id) == col(VersionRow.model_id))
        .where(
            col(Rollout.deployment_id).in_(deployments),
            col(Rollout.state).in_(ACTIVE_STATES),
            col(Rollout.phase) == RolloutPhase.STAGING,
        )
    ).all()
    return [_model_ref(r) for r in rows]


def _canary_configs(
    conn: Connection, deployment_ids: set[int]
) -> dict[tuple[int, int], dict[str, Any]]:
    """(deployment id, canary version id) -> engine config, for the active rollouts among
    DEPLOYMENT_IDS that bring an engine config of their own."""
    if not deployment_ids:
        return {}
    rows = conn.execute(
        select(col(Rollout.deployment_id), col(Rollout.to_version_id), col(Rollout.engine_config))
        .where(
            col(Rollout.deployment_id).in_(deployment_ids),
            col(Rollout.state).in_(ACTIVE_STATES),
            col(Rollout.kind) != RolloutKind.RESTART,
        )
        .order_by(col(Rollout.id))
    ).all()
    # JSON columns store None as JSON null, so the filter is here rather than in SQL.
    return {(r[0], r[1]): r[2] for r in rows if r[2] is not None}


def keep_version_ids(conn: Connection, host_id: int) -> set[int]:
    """Versions host `host_id` keeps: of each deployment with an instance there, the stable
    version, the rollback target and an active rollout's version (so a rollback or an abort
    finds its snapshot on the host, with nothing to download, and a rollout can pre-stage)."""
    deployments = select(col(Instance.deployment_id)).where(col(Instance.host_id) == host_id)
    rows = conn.execute(
        select(col(Deployment.stable_version_id), col(Deployment.rollback_version_id)).where(
            col(Deployment.id).in_(deployments)
        )
    ).all()
    ids = {v for row in rows for v in row if v is not None}
    ids |= set(
        conn.execute(
            select(col(Rollout.to_version_id)).where(
                col(Rollout.deployment_id).in_(deployments),
                col(Rollout.state).in_(ACTIVE_STATES),
            )
        ).scalars()
    )
    return ids


def keep_digests(conn: Connection, host_id: int) -> list[str]:
    """The digests of `keep_version_ids`: what the host's agent must not prune."""
    ids = keep_version_ids(conn, host_id)
    if not ids:
        return []
    digests = conn.execute(
        select(col(VersionRow.digest)).where(col(VersionRow.id).in_(ids))
    ).scalars()
    return sorted(set(digests))
