"""`/api/v1/hosts`: list, show, samples, label and drain / undrain (operator), re-key and remove
(admin)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlmodel import Session, col

from controlplane.api.deps import Admin, AppContext, ContextDep, Operator, SessionDep, Viewer
from controlplane.api.views import host_out, instances_out, token_out
from controlplane.models import Host, Instance
from controlplane.services import hosts, tokens
from protocol.rest import HostLabelChange, HostOut, SeriesOut, TokenCreated
from protocol.wire import HostState

router = APIRouter(prefix="/api/v1/hosts", tags=["hosts"])


def _with_instances(session: Session, ctx: AppContext, host: Host) -> HostOut:
    instances = instances_out(session, col(Instance.host_id) == host.id)
    return host_out(host, instances, hosts.holds_agent_token(session, ctx.clock(), host))


@router.get("", response_model=list[HostOut])
def list_hosts(session: SessionDep, _who: Viewer, state: HostState | None = None) -> list[HostOut]:
    """Every host (optionally only those in `state`) with GPUs and latest samples."""
    return [host_out(h) for h in hosts.list_hosts(session, state)]


@router.get("/{name}", response_model=HostOut)
def show_host(name: str, session: SessionDep, ctx: ContextDep, _who: Viewer) -> HostOut:
    """One host with its GPUs, latest samples and instances."""
    return _with_instances(session, ctx, hosts.get_host(session, name))


@router.get("/{name}/samples", response_model=list[SeriesOut])
def host_samples(
    name: str,
    session: SessionDep,
    ctx: ContextDep,
    _who: Viewer,
    series: Annotated[
        str | None, Query(max_length=128, description="exact name or prefix.*")
    ] = None,
    minutes: Annotated[int, Query(ge=1, le=24 * 60)] = 15,
) -> list[SeriesOut]:
    """Downsampled history (10 s points) of the host's GPU and instance series, oldest first."""
    host = hosts.get_host(session, name)
    since = ctx.clock() - timedelta(minutes=minutes)
    grouped = hosts.samples(session, host, since, series)
    return [
        SeriesOut(name=key[0], instance_id=key[1], points=points)
        for key, points in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
    ]


@router.patch("/{name}/labels", response_model=HostOut)
def label_host(
    name: str, body: HostLabelChange, session: SessionDep, ctx: ContextDep, who: Operator
) -> HostOut:
    """Change the labels placement reads; deployments placed by label follow at once.

    Operator, as drain is: an operator may already place a deployment on any host by name.
    """
    host = hosts.change_labels(session, ctx.clock(), who.actor, name, body)
    session.commit()
    return _with_instances(session, ctx, host)


@router.post("/{name}/drain", response_model=HostOut)
def drain_host(name: str, session: SessionDep, ctx: ContextDep, who: Operator) -> HostOut:
    """Stop the host's instances and place nothing new there until undrained."""
    host = hosts.set_draining(session, ctx.clock(), who.actor, name, True)
    session.commit()
    return _with_instances(session, ctx, host)


@router.post("/{name}/undrain", response_model=HostOut)
def undrain_host(name: str, session: SessionDep, ctx: ContextDep, who: Operator) -> HostOut:
    """Let the host run its instances again."""
    host = hosts.set_draining(session, ctx.clock(), who.actor, name, False)
    session.commit()
    return _with_instances(session, ctx, host)


@router.post("/{name}/rekey", response_model=TokenCreated, status_code=201)
def rekey_host(name: str, session: SessionDep, ctx: ContextDep, who: Admin) -> TokenCreated:
    """A one-use bootstrap token (24 h) that registers this host again, and only it.

    Its secret appears in this response only. The host's agent token keeps working until an
    agent registers with the new token; then every older token of the host is revoked.
    """
    new = tokens.rekey_host(session, ctx.clock(), who.actor, name)
    session.commit()
    return TokenCreated(**token_out(new.row, name).model_dump(), secret=new.secret)


@router.delete("/{name}", status_code=204)
def remove_host(name: str, session: SessionDep, ctx: ContextDep, who: Admin) -> Response:
    """Forget a host: its GPUs, instances and agent tokens go with it."""
    host_id = hosts.remove_host(session, ctx.clock(), who.actor, name)
    session.commit()
    ctx.heartbeats.forget_host(host_id)
    ctx.token_cache.drop_host(host_id)
    return Response(status_code=204)
