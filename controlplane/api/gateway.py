"""`/api/v1/routes` and `/api/v1/traffic`: what gateways read and report (role gateway only).

Not even an admin token reads the routing table: it carries every engine's API key, and the
gateway role exists so that the one secret able to reach every engine is held by gateways alone.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Response

from controlplane.api.deps import ContextDep, Gateway, SessionDep
from controlplane.services import routes, traffic
from protocol.gateway import RouteTable, TrafficAccepted, TrafficReport

router = APIRouter(prefix="/api/v1", tags=["gateway"])


@router.get(
    "/routes",
    response_model=RouteTable,
    responses={304: {"description": "unchanged since the ETag in If-None-Match"}},
)
def read_routes(
    session: SessionDep,
    ctx: ContextDep,
    _who: Gateway,
    if_none_match: Annotated[str | None, Header(max_length=1024)] = None,
) -> Response:
    """The routing table: per deployment its stable and canary pools of ready instances (with
    their API keys) and the canary weight, and the client tokens' hashes.

    Answered 304 with no body while `If-None-Match` names the current ETag, so polling it every
    second costs a gateway nothing but the request.
    """
    table = routes.routing_table(session, ctx.clock())
    headers = {"ETag": f'"{table.etag}"', "Cache-Control": "no-cache"}
    if routes.etag_matches(if_none_match, table.etag):
        return Response(status_code=304, headers=headers)
    return Response(table.model_dump_json(), media_type="application/json", headers=headers)


@router.post("/traffic", response_model=TrafficAccepted)
def report_traffic(
    body: TrafficReport, session: SessionDep, ctx: ContextDep, _who: Gateway
) -> TrafficAccepted:
    """Store a gateway's traffic windows; those of unknown deployments or versions are skipped
    and listed in the answer, never a failure of the whole report."""
    accepted = traffic.record_report(session, ctx.clock(), body)
    session.commit()
    return accepted
