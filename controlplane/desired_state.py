"""A host's desired state as its agent receives it: the wire `DesiredInstance` of each instance.

Read only for the host whose agent asks (the heartbeat is scoped to the token's host), since it
carries the engines' API keys.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.engine import Connection
from sqlmodel import col

from controlplane.models import Deployment, Instance, Model
from controlplane.models import ModelVersion as VersionRow
from protocol.sources import local_source_dir
from protocol.wire import DesiredInstance, Manifest, MemoryPlan, ModelVersionRef

# Where engines listen when the agent did not say which address other machines reach it on.
DEFAULT_BIND_ADDRESS = "127.0.0.1"


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
            col(Deployment.name).label("deployment"),
            col(Deployment.engine_config),
            col(Model.name).label("model"),
            col(VersionRow.version),
            col(VersionRow.digest),
            col(VersionRow.line),
            col(VersionRow.manifest),
            col(VersionRow.source_uri),
            col(VersionRow.memory_plan),
        )
        .join(Deployment, col(Deployment.id) == col(Instance.deployment_id))
        .join(VersionRow, col(VersionRow.id) == col(Instance.version_id))
        .join(Model, col(Model.id) == col(VersionRow.model_id))
        .where(col(Instance.host_id) == host_id)
        .order_by(col(Instance.id))
    ).all()
    bind_address = advertise_address or DEFAULT_BIND_ADDRESS
    desired = []
    for r in rows:
        files_url = None
        if local_source_dir(r.source_uri) is not None:
            files_url = f"/api/v1/models/{r.model}/versions/{r.version}/files/"
        desired.append(
            DesiredInstance(
                instance_id=r.id,
                deployment=r.deployment,
                port=r.port,
                engine_config=r.engine_config,
                desired_state=r.desired_state,
                gpu_indices=r.gpu_indices or [],
                bind_address=bind_address,
                # An instance without a key ("") is served without one.
                api_key=r.api_key or None,
                model=ModelVersionRef(
                    name=r.model,
                    version=r.version,
                    digest=r.digest,
                    line=r.line,
                    manifest=Manifest(files=r.manifest),
                    source_uri=r.source_uri,
                    files_url=files_url,
                    memory_plan=MemoryPlan(**r.memory_plan) if r.memory_plan else None,
                ),
            )
        )
    return desired
