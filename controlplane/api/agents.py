"""`/api/v1/agents`: registration (bootstrap or the host's agent token) and heartbeats."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from controlplane.api.deps import ContextDep, Registrant, SessionDep, get_context
from controlplane.api.errors import ApiError
from controlplane.api.heartbeat_fastpath import FAST_PATH_ERROR
from controlplane.auth import AuthError
from controlplane.heartbeat.rate_limit import HeartbeatTooSoon, RegisterTooSoon
from controlplane.services.registration import register_agent as register
from protocol.wire import HeartbeatReply, RegisterRequest, RegisterResponse

router = APIRouter(prefix="/api/v1/agents", tags=["agents"])


@router.post("/register", response_model=RegisterResponse)
def register_agent(
    body: RegisterRequest, session: SessionDep, ctx: ContextDep, who: Registrant
) -> RegisterResponse:
    """Create the host, or register it again (its agent token, or an admin's re-key token),
    and return an agent token bound to it, shown once. Another caller naming a registered host
    gets 409 saying how to re-key it. A host name registering too often gets 429."""
    now = ctx.clock()
    try:
        # After authentication (the dependency, read only), before any write: an anonymous
        # caller spends nothing, an authenticated one looping on one name is stopped here.
        ctx.registrations.admit(body.name, now)
    except RegisterTooSoon as exc:
        retry = {"Retry-After": str(exc.retry_after_s)}
        raise ApiError(429, "rate_limited", str(exc), headers=retry) from exc
    try:
        # The token's use is spent only if the registration commits with it.
        done = register(
            session,
            now,
            body,
            caller=who,
            heartbeat_interval_s=ctx.settings.heartbeat_interval_s,
        )
        session.commit()
    except AuthError as exc:
        ctx.registrations.refund(body.name)
        raise ApiError(401, "unauthorized", str(exc)) from exc
    except Exception:
        # Refused (403, 409) or failed: nothing was written, so nothing is spent.
        ctx.registrations.refund(body.name)
        raise
    # Not needed for correctness (registration bumps the host's heartbeat_seq and revokes the
    # old token), but this replica's memory of the old agent is of no further use. Its rate
    # limit stays: registering again must not buy a host a fresh burst of heartbeats.
    ctx.heartbeats.forget(done.host_id)
    ctx.token_cache.drop_host(done.host_id)
    return RegisterResponse(
        host_id=done.host_id,
        host_name=done.host_name,
        agent_token=done.agent_token,
        heartbeat_interval_s=done.heartbeat_interval_s,
    )


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
    """Commit last-seen time and observed state, then reply with the desired state.

    Most heartbeats are answered by the fast lane (api/heartbeat_fastpath.py) with the same
    `HeartbeatService.answer`; this route maps the errors of its attempts (raised again, not
    run again) and answers what it did not take. Forbidden (403) and host_removed (404) are
    domain errors, mapped like every other; a host heartbeating too fast gets 429.
    """
    ctx = await get_context(request)
    try:
        failed = request.scope.pop(FAST_PATH_ERROR, None)
        if failed is not None:
            raise failed
        reply = await ctx.heartbeats.answer(
            request.headers.get("authorization"),
            await request.body(),
        )
    except AuthError as exc:
        raise ApiError(401, "unauthorized", str(exc)) from exc
    except HeartbeatTooSoon as exc:
        retry = {"Retry-After": str(exc.retry_after_s)}
        raise ApiError(429, "rate_limited", str(exc), headers=retry) from exc
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_context=False)) from exc
    return Response(reply, media_type="application/json")
