"""`/api/v1/deployments`: create, list, show, update (scale, GPUs, engine config, version,
placement), delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Response
from fastapi import Path as PathParam

from controlplane.api.deps import ContextDep, Operator, SessionDep, Viewer
from controlplane.api.views import deployments_out
from controlplane.services import deployments
from protocol.rest import DeploymentCreate, DeploymentOut, DeploymentUpdate

router = APIRouter(prefix="/api/v1/deployments", tags=["deployments"])

NamePath = Annotated[str, PathParam(max_length=63)]


@router.post("", response_model=DeploymentOut, status_code=201)
def create_deployment(
    body: DeploymentCreate, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Create a deployment; instances are derived per host, each with its own port and GPUs."""
    deployment = deployments.create_deployment(session, ctx.clock(), who.actor, body)
    session.commit()
    return deployments_out(session, [deployment])[0]


@router.get("", response_model=list[DeploymentOut])
def list_deployments(session: SessionDep, _who: Viewer) -> list[DeploymentOut]:
    """Every deployment with its instances."""
    return deployments_out(session, deployments.list_deployments(session))


@router.get("/{name}", response_model=DeploymentOut)
def show_deployment(name: NamePath, session: SessionDep, _who: Viewer) -> DeploymentOut:
    """One deployment with its instances."""
    return deployments_out(session, [deployments.get_deployment(session, name)])[0]


@router.patch("/{name}", response_model=DeploymentOut)
def update_deployment(
    name: NamePath, body: DeploymentUpdate, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Scale, change GPUs per instance or engine config, switch the stable version or placement."""
    deployment = deployments.update_deployment(session, ctx.clock(), who.actor, name, body)
    session.commit()
    return deployments_out(session, [deployment])[0]


@router.delete("/{name}", status_code=204)
def delete_deployment(
    name: NamePath, session: SessionDep, ctx: ContextDep, who: Operator
) -> Response:
    """Delete a deployment; its instances are stopped on their hosts."""
    deployments.delete_deployment(session, ctx.clock(), who.actor, name)
    session.commit()
    return Response(status_code=204)
