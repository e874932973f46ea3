"""`/api/v1/agents`: registration (bootstrap token) and heartbeats (agent token)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sqlalchemy import update
from sqlmodel import col, select

from controlplane.api.deps import Bootstrap, ContextDep, RoleGate, SessionDep, get_context
from controlplane.api.errors import ApiError
from controlplane.auth import Role, consume_use, mint_token
from controlplane.eventlog import record_event
from controlplane.heartbeats import UnknownHostError
from controlplane.models import ApiToken, Host
from controlplane.placement import reconcile_host
from protocol.wire import Heartbeat, HeartbeatReply, RegisterRequest, RegisterResponse

router = APIRouter(prefix="/api/v1/agents", tags=["agents"])


@router.post("/register", response_model=RegisterResponse)
def register_agent(
    body: RegisterRequest, session: SessionDep, ctx: ContextDep, who: Bootstrap
) -> RegisterResponse:
    """Create (or re-key) the host and return an agent token bound to it, shown once."""
    now = ctx.clock()
    if not consume_use(session, who.token_id):
        raise ApiError(401, "unauthorized", f"token {who.name!r} has no uses left")
    host = session.exec(select(Host).where(Host.name == body.name)).first()
    facts = body.facts.model_dump(mode="json") if body.facts else {}
    interval = ctx.settings.heartbeat_interval_s
    if host is None:
        host = Host(name=body.name, registered_at=now, heartbeat_interval_s=interval)
        kind, verb = "host.registered", "registered"
    else:
        # An agent that lost its data dir registers again: the old agent token stops working.
        session.execute(
            update(ApiToken)
            .where(col(ApiToken.host_id) == host.id, col(ApiToken.revoked_at).is_(None))
            .values(revoked_at=now)
        )
        kind, verb = "host.reregistered", "registered again"
    host.labels = dict(body.labels)
    host.port_range_start, host.port_range_end = body.port_range
    host.heartbeat_interval_s = interval
    host.last_seen_at = now
    host.state = "ready"
    if facts:
        host.facts = facts
    session.add(host)
    session.flush()
    assert host.id is not None
    new = mint_token(
        f"agent-{body.name}"[:63], Role.AGENT, now, host_id=host.id, created_by=who.actor
    )
    session.add(new.row)
    reconcile_host(session, host, now)
    record_event(
        session,
        now,
        who.actor,
        kind,
        f"host/{body.name}",
        f"host {body.name} {verb} (ports {body.port_range[0]}-{body.port_range[1]})",
        labels=body.labels,
    )
    session.commit()
    ctx.heartbeats.forget(host.id)
    ctx.token_cache.drop_host(host.id)
    return RegisterResponse(
        host_id=host.id,
        host_name=host.name,
        agent_token=new.secret,
        heartbeat_interval_s=interval,
    )


# The heartbeat route calls its role gate itself instead of declaring dependencies: the same
# check, without FastAPI's dependency solving on the hottest route.
_AGENT_GATE = RoleGate(Role.AGENT)

# The body is parsed by pydantic straight from the JSON bytes (one pass, in Rust) rather than
# through FastAPI's generic body handling: this is the hottest route of the control plane.
_HEARTBEAT_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Heartbeat"}}},
    }
}


@router.post("/heartbeat", response_model=HeartbeatReply, openapi_extra=_HEARTBEAT_BODY)
async def heartbeat(request: Request) -> Response:
    """Commit last-seen time and observed state, then reply with the desired state."""
    ctx = await get_context(request)
    who = await _AGENT_GATE(request, ctx)
    if who.host_id is None:
        raise ApiError(403, "forbidden", "this agent token is not bound to a host: register again")
    try:
        body = Heartbeat.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc
    try:
        reply = await ctx.heartbeats.submit(who.host_id, body, lambda: str(request.base_url))
    except UnknownHostError as exc:
        raise ApiError(404, "host_removed", str(exc)) from exc
    return Response(reply, media_type="application/json")
