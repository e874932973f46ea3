"""`/api/v1/deployments`: create, list, show, update (scale, engine config, version), delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Response
from fastapi import Path as PathParam
from sqlalchemy import delete
from sqlmodel import Session, col, select

from controlplane.api.deps import ContextDep, Operator, SessionDep, Viewer
from controlplane.api.errors import conflict, invalid, not_found
from controlplane.api.views import deployment_out
from controlplane.eventlog import record_event
from controlplane.models import Deployment, Host, Instance, Model, ModelVersion
from controlplane.placement import PlacementError, bump_generation, reconcile_deployment
from protocol.rest import DeploymentCreate, DeploymentOut, DeploymentUpdate, Placement

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])

NamePath = Annotated[str, PathParam(max_length=63)]


def get_deployment(session: Session, name: str) -> Deployment:
    """The deployment called `name`, or 404."""
    row = session.exec(select(Deployment).where(Deployment.name == name)).first()
    if row is None:
        raise not_found(f"deployment {name!r}")
    return row


def _resolve_version(session: Session, model_name: str, tag: str) -> tuple[Model, ModelVersion]:
    model = session.exec(select(Model).where(Model.name == model_name)).first()
    version = (
        session.exec(
            select(ModelVersion).where(
                ModelVersion.model_id == model.id, ModelVersion.version == tag
            )
        ).first()
        if model
        else None
    )
    if model is None or version is None:
        raise invalid(f"model version {model_name}:{tag} is not registered: `dctl model register`")
    if version.deprecated:
        raise invalid(f"{model_name}:{tag} is deprecated: deploy a newer version")
    return model, version


def _check_placement(session: Session, placement: Placement) -> None:
    if not placement.hosts and not placement.labels:
        raise invalid("placement: name hosts or labels (e.g. {'hosts': ['gpu-1']})")
    known = set(session.exec(select(Host.name).where(col(Host.name).in_(placement.hosts))).all())
    missing = [h for h in placement.hosts if h not in known]
    if missing:
        raise invalid(f"placement: host(s) {', '.join(missing)} not registered (`dctl host list`)")


def _reconcile(session: Session, deployment: Deployment, ctx: ContextDep) -> None:
    try:
        reconcile_deployment(session, deployment, ctx.clock())
    except PlacementError as exc:
        session.rollback()
        raise conflict(str(exc)) from exc


@router.post("", response_model=DeploymentOut, status_code=201)
def create_deployment(
    body: DeploymentCreate, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Create a deployment; instances are derived per host, each with its own port."""
    if session.exec(select(Deployment.id).where(Deployment.name == body.name)).first():
        raise conflict(f"deployment {body.name!r} already exists: update or delete it")
    model, version = _resolve_version(session, body.model, body.version)
    _check_placement(session, body.placement)
    now = ctx.clock()
    assert model.id is not None and version.id is not None
    deployment = Deployment(
        name=body.name,
        model_id=model.id,
        stable_version_id=version.id,
        engine_config=body.engine_config,
        placement_hosts=list(body.placement.hosts),
        placement_labels=dict(body.placement.labels),
        instances_per_host=body.instances_per_host,
        created_at=now,
        updated_at=now,
    )
    session.add(deployment)
    session.flush()
    _reconcile(session, deployment, ctx)
    record_event(
        session,
        now,
        who.actor,
        "deployment.created",
        f"deployment/{body.name}",
        f"deployment {body.name} created: {body.model}:{body.version}, "
        f"{body.instances_per_host} per host",
        model=body.model,
        version=body.version,
    )
    session.commit()
    return deployment_out(session, deployment)


@router.get("", response_model=list[DeploymentOut])
def list_deployments(session: SessionDep, _who: Viewer) -> list[DeploymentOut]:
    """Every deployment with its instances."""
    rows = session.exec(select(Deployment).order_by(col(Deployment.name))).all()
    return [deployment_out(session, d) for d in rows]


@router.get("/{name}", response_model=DeploymentOut)
def show_deployment(name: NamePath, session: SessionDep, _who: Viewer) -> DeploymentOut:
    """One deployment with its instances."""
    return deployment_out(session, get_deployment(session, name))


@router.patch("/{name}", response_model=DeploymentOut)
def update_deployment(
    name: NamePath, body: DeploymentUpdate, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Scale, change engine config, switch the stable version or the placement."""
    deployment = get_deployment(session, name)
    now = ctx.clock()
    changes: dict[str, object] = {}
    if body.instances_per_host is not None:
        deployment.instances_per_host = body.instances_per_host
        changes["instances_per_host"] = body.instances_per_host
    if body.engine_config is not None:
        deployment.engine_config = body.engine_config
        changes["engine_config"] = True
    if body.version is not None:
        model = session.get(Model, deployment.model_id)
        assert model is not None
        _model, version = _resolve_version(session, model.name, body.version)
        assert version.id is not None
        deployment.stable_version_id = version.id
        changes["version"] = body.version
    if body.placement is not None:
        _check_placement(session, body.placement)
        deployment.placement_hosts = list(body.placement.hosts)
        deployment.placement_labels = dict(body.placement.labels)
        changes["placement"] = body.placement.model_dump()
    if not changes:
        raise invalid(
            "nothing to update: give instances_per_host, engine_config, version or placement"
        )
    deployment.updated_at = now
    session.add(deployment)
    session.flush()
    _reconcile(session, deployment, ctx)
    if body.engine_config is not None:
        # Config changes reach every host of the deployment even when no instance row changed.
        hosts = session.exec(
            select(Instance.host_id).where(Instance.deployment_id == deployment.id)
        ).all()
        bump_generation(session, hosts)
    record_event(
        session,
        now,
        who.actor,
        "deployment.updated",
        f"deployment/{name}",
        f"deployment {name} updated: {', '.join(changes)}",
        **changes,
    )
    session.commit()
    return deployment_out(session, deployment)


@router.delete("/{name}", status_code=204)
def delete_deployment(
    name: NamePath, session: SessionDep, ctx: ContextDep, who: Operator
) -> Response:
    """Delete a deployment; its instances are stopped on their hosts."""
    deployment = get_deployment(session, name)
    hosts = session.exec(
        select(Instance.host_id).where(Instance.deployment_id == deployment.id)
    ).all()
    session.execute(delete(Instance).where(col(Instance.deployment_id) == deployment.id))
    session.delete(deployment)
    bump_generation(session, hosts)
    record_event(
        session,
        ctx.clock(),
        who.actor,
        "deployment.deleted",
        f"deployment/{name}",
        f"deployment {name} deleted",
    )
    session.commit()
    return Response(status_code=204)
