"""`/healthz`, `/readyz`, `/metrics` (no token) and `/api/v1/status` (viewer)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from sqlalchemy import func
from sqlmodel import col, select

from controlplane.api.deps import ContextDep, SessionDep, Viewer
from controlplane.api.errors import ApiError
from controlplane.db import ping
from controlplane.metrics import CONTENT_TYPE
from controlplane.models import Deployment, Gpu, Host, Instance, Model, ModelVersion
from protocol.rest import FleetStatus

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: ContextDep) -> dict[str, str]:
    """The database answers."""
    if not ping(ctx.engine):
        raise ApiError(503, "unavailable", "the database does not answer: check --db / its server")
    return {"status": "ready"}


@router.get("/metrics")
def metrics(ctx: ContextDep) -> Response:
    """Prometheus text format: requests, heartbeats, hosts by state, heartbeat lag."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/api/v1/status", response_model=FleetStatus)
def fleet_status(session: SessionDep, _who: Viewer) -> FleetStatus:
    """Counts for `dctl status`."""

    def count(model: type) -> int:
        return int(session.exec(select(func.count()).select_from(model)).one())

    hosts = dict(session.exec(select(Host.state, func.count()).group_by(col(Host.state))).all())
    instances = dict(
        session.exec(
            select(Instance.observed_state, func.count()).group_by(col(Instance.observed_state))
        ).all()
    )
    draining = session.exec(select(func.count()).where(col(Host.draining).is_(True))).one()
    return FleetStatus(
        hosts_by_state={k: int(v) for k, v in hosts.items()},
        hosts_draining=int(draining),
        gpus=count(Gpu),
        models=count(Model),
        versions=count(ModelVersion),
        deployments=count(Deployment),
        instances_by_state={k: int(v) for k, v in instances.items()},
    )
