"""`/api/v1/hosts`: list, show, drain / undrain (operator), remove (admin)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, Response
from sqlmodel import Session, col, select

from controlplane.api.deps import Admin, ContextDep, Operator, SessionDep, Viewer
from controlplane.api.errors import ApiError, not_found
from controlplane.api.views import host_out, instances_out
from controlplane.eventlog import record_event
from controlplane.models import Host, Instance, MetricSample
from controlplane.placement import reconcile_host
from protocol.rest import HostOut, SeriesOut
from protocol.wire import HostState

router = APIRouter(prefix="/api/v1/hosts", tags=["hosts"])


def get_host(session: Session, name: str) -> Host:
    """The host called `name`, or 404."""
    host = session.exec(select(Host).where(Host.name == name)).first()
    if host is None:
        raise not_found(f"host {name!r}")
    return host


@router.get("", response_model=list[HostOut])
def list_hosts(session: SessionDep, _who: Viewer, state: HostState | None = None) -> list[HostOut]:
    """Every host (optionally only those in `state`) with GPUs and latest samples."""
    query = select(Host).order_by(col(Host.name))
    if state is not None:
        query = query.where(Host.state == state.value)
    return [host_out(h) for h in session.exec(query).all()]


@router.get("/{name}", response_model=HostOut)
def show_host(name: str, session: SessionDep, _who: Viewer) -> HostOut:
    """One host with its GPUs, latest samples and instances."""
    host = get_host(session, name)
    return host_out(host, instances_out(session, col(Instance.host_id) == host.id))


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
    host = get_host(session, name)
    query = select(MetricSample).where(
        MetricSample.host_id == host.id,
        col(MetricSample.time) >= ctx.clock() - timedelta(minutes=minutes),
    )
    if series:
        if series.endswith(".*"):
            query = query.where(col(MetricSample.name).startswith(series[:-1]))
        else:
            query = query.where(MetricSample.name == series)
    grouped: dict[tuple[str, int | None], list[tuple[datetime, float]]] = {}
    for sample in session.exec(query.order_by(col(MetricSample.time))).all():
        grouped.setdefault((sample.name, sample.instance_id), []).append(
            (sample.time, sample.value)
        )
    return [
        SeriesOut(name=key[0], instance_id=key[1], points=points)
        for key, points in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
    ]


def _set_draining(
    name: str, draining: bool, session: Session, ctx: ContextDep, actor: str
) -> HostOut:
    host = get_host(session, name)
    now = ctx.clock()
    if host.draining != draining:
        host.draining = draining
        session.add(host)
        session.flush()
        reconcile_host(session, host, now)
        verb = "draining: its instances are stopped" if draining else "no longer draining"
        record_event(
            session,
            now,
            actor,
            "host.drained" if draining else "host.undrained",
            f"host/{name}",
            f"host {name} is {verb}",
        )
        session.commit()
        session.refresh(host)
    return host_out(host, instances_out(session, col(Instance.host_id) == host.id))


@router.post("/{name}/drain", response_model=HostOut)
def drain_host(name: str, session: SessionDep, ctx: ContextDep, who: Operator) -> HostOut:
    """Stop the host's instances and place nothing new there until undrained."""
    return _set_draining(name, True, session, ctx, who.actor)


@router.post("/{name}/undrain", response_model=HostOut)
def undrain_host(name: str, session: SessionDep, ctx: ContextDep, who: Operator) -> HostOut:
    """Let the host run its instances again."""
    return _set_draining(name, False, session, ctx, who.actor)


@router.delete("/{name}", status_code=204)
def remove_host(name: str, session: SessionDep, ctx: ContextDep, who: Admin) -> Response:
    """Forget a host: its GPUs, instances and agent tokens go with it."""
    host = get_host(session, name)
    if host.id is None:
        raise ApiError(500, "internal", "host without id")
    host_id = host.id
    session.delete(host)
    record_event(
        session, ctx.clock(), who.actor, "host.removed", f"host/{name}", f"host {name} removed"
    )
    session.commit()
    ctx.heartbeats.forget(host_id)
    ctx.token_cache.drop_host(host_id)
    return Response(status_code=204)
