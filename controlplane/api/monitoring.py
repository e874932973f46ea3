"""`/api/v1/gateways` (gateways heartbeat, viewers list them) and `/api/v1/metrics/targets`."""

from __future__ import annotations

from fastapi import APIRouter

from controlplane.api.deps import ContextDep, Gateway, SessionDep, Viewer
from controlplane.services import gateways, targets
from protocol.monitoring import (
    GATEWAY_HEARTBEAT_PATH,
    GATEWAYS_PATH,
    TARGETS_PATH,
    GatewayHeartbeat,
    GatewayOut,
    ScrapeTargetGroup,
)

router = APIRouter(tags=["monitoring"])


@router.post(GATEWAY_HEARTBEAT_PATH, response_model=GatewayOut)
def gateway_heartbeat(
    body: GatewayHeartbeat, session: SessionDep, ctx: ContextDep, who: Gateway
) -> GatewayOut:
    """Record where a gateway serves and its /metrics; the first beat registers it. Gateway
    tokens only (the same that read the routing table)."""
    now = ctx.clock()
    row = gateways.record_heartbeat(session, now, body, who.name)
    return gateways.gateway_out(row, now)


@router.get(GATEWAYS_PATH, response_model=list[GatewayOut])
def list_gateways(session: SessionDep, ctx: ContextDep, _who: Viewer) -> list[GatewayOut]:
    """Every gateway that heartbeated (within the sample retention), with whether it is live."""
    return gateways.list_gateways(session, ctx.clock())


@router.get(TARGETS_PATH, response_model=list[ScrapeTargetGroup])
def scrape_targets(session: SessionDep, ctx: ContextDep, _who: Viewer) -> list[ScrapeTargetGroup]:
    """Prometheus `file_sd` groups of every live target: this control plane (at its
    `public_url`), agents, ready engine instances and gateways, with their labels."""
    control_plane = targets.control_plane_group(ctx.settings.resolved_public_url())
    return targets.scrape_targets(session, ctx.clock(), control_plane)
