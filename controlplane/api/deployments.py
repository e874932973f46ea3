"""`/api/v1/deployments`: create, list, show, update (scale, GPUs, engine config, version,
placement), delete; its canary (set, end) and the traffic the gateways served it."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi import Path as PathParam

from controlplane.api.deps import ContextDep, Operator, SessionDep, Viewer, Waker
from controlplane.api.views import canary_out, deployments_out
from controlplane.auth import Role
from controlplane.services import autoscale, canary, deployments, traffic
from protocol.autoscale import AutoscalePolicy
from protocol.gateway import CanaryOut, CanarySet, DeploymentTraffic
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
    return deployments_out(session, [deployment], admin=who.may(Role.ADMIN))[0]


@router.get("", response_model=list[DeploymentOut])
def list_deployments(session: SessionDep, who: Viewer) -> list[DeploymentOut]:
    """Every deployment with its instances."""
    found = deployments.list_deployments(session)
    return deployments_out(session, found, admin=who.may(Role.ADMIN))


@router.get("/{name}", response_model=DeploymentOut)
def show_deployment(name: NamePath, session: SessionDep, who: Viewer) -> DeploymentOut:
    """One deployment with its instances."""
    found = deployments.get_deployment(session, name)
    return deployments_out(session, [found], admin=who.may(Role.ADMIN))[0]


@router.patch("/{name}", response_model=DeploymentOut)
def update_deployment(
    name: NamePath, body: DeploymentUpdate, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Scale, change GPUs per instance or engine config, switch the stable version or placement,
    set the rollout policy (a `notify` URL to a private address needs
    `[controlplane] notify_allow_private`)."""
    allow_private = ctx.settings.notify_allow_private
    deployment = deployments.update_deployment(
        session, ctx.clock(), who.actor, name, body, allow_private
    )
    session.commit()
    return deployments_out(session, [deployment], admin=who.may(Role.ADMIN))[0]


@router.delete("/{name}", status_code=204)
def delete_deployment(
    name: NamePath, session: SessionDep, ctx: ContextDep, who: Operator
) -> Response:
    """Delete a deployment; its instances are stopped on their hosts."""
    deployments.delete_deployment(session, ctx.clock(), who.actor, name)
    session.commit()
    return Response(status_code=204)


@router.put("/{name}/autoscale", response_model=DeploymentOut)
def set_autoscale(
    name: NamePath, body: AutoscalePolicy, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Scale the deployment on its load between `min` and `max` serving instances, with
    `standby` loaded ones out of the pools; again to change the policy. Refused (nothing
    changes) when the count it starts from does not fit."""
    deployment = autoscale.set_policy(session, ctx.clock(), who.actor, name, body)
    session.commit()
    return deployments_out(session, [deployment], admin=who.may(Role.ADMIN))[0]


@router.delete("/{name}/autoscale", response_model=DeploymentOut)
def clear_autoscale(
    name: NamePath, session: SessionDep, ctx: ContextDep, who: Operator
) -> DeploymentOut:
    """Stop autoscaling: the deployment keeps the serving instances it has; standby ones stop."""
    deployment = autoscale.clear_policy(session, ctx.clock(), who.actor, name)
    session.commit()
    return deployments_out(session, [deployment], admin=who.may(Role.ADMIN))[0]


@router.post("/{name}/wake", status_code=202)
def wake(name: NamePath, session: SessionDep, ctx: ContextDep, _who: Waker) -> Response:
    """A request waits at a gateway for this deployment, scaled to zero: start an instance.
    202 when one will start, 204 when the deployment is not scaled to zero (nothing to do)."""
    woken = autoscale.request_wake(session, ctx.clock(), name)
    session.commit()
    return Response(status_code=202 if woken else 204)


@router.put("/{name}/canary", response_model=CanaryOut)
def set_canary(
    name: NamePath, body: CanarySet, session: SessionDep, ctx: ContextDep, who: Operator
) -> CanaryOut:
    """Run another version of the model on some instances and send it a share of the gateway's
    requests; again with the same version to change the share or the instances."""
    result = canary.set_canary(session, ctx.clock(), who.actor, name, body)
    session.commit()
    return canary_out(result)


@router.delete("/{name}/canary", response_model=CanaryOut)
def clear_canary(name: NamePath, session: SessionDep, ctx: ContextDep, who: Operator) -> CanaryOut:
    """End the canary: its instances run the stable version again and take no more requests."""
    result = canary.clear_canary(session, ctx.clock(), who.actor, name)
    session.commit()
    return canary_out(result)


@router.get("/{name}/traffic", response_model=DeploymentTraffic)
def deployment_traffic(
    name: NamePath,
    session: SessionDep,
    ctx: ContextDep,
    _who: Viewer,
    since: Annotated[datetime | None, Query(description="default: until - 5 min")] = None,
    until: Annotated[datetime | None, Query(description="default: now")] = None,
    step_s: Annotated[
        int | None, Query(description=f"seconds per series point, 1..{traffic.MAX_STEP_S}")
    ] = None,
) -> DeploymentTraffic:
    """What the gateways served the deployment, per version, merged over every gateway whose
    windows ended in (since, until] (at most 24 h): counts, error rate, latency and TTFT
    quantiles, a series of `step_s` steps, and the engines' denoising steps per block and
    tokens per forward."""
    return traffic.deployment_traffic(session, ctx.clock(), name, since, until, step_s)
