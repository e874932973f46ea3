"""Request dependencies: the app context, a database session, and the calling token's role."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from controlplane.api.errors import ApiError
from controlplane.auth import (
    AgentTokenCache,
    AuthError,
    Principal,
    Role,
    TokenRefused,
    authenticate,
    consume_use,
)
from controlplane.auth import parse_authorization as parse_header
from controlplane.controllers.host_health import HostHealthMonitor
from controlplane.db import session_scope
from controlplane.heartbeat.rate_limit import RegistrationRateLimit
from controlplane.heartbeat.service import HeartbeatService
from controlplane.metrics import ControlPlaneMetrics
from controlplane.settings import ControlPlaneSettings
from protocol.api_model import non_finite_number


@dataclass
class AppContext:
    """Everything a request handler may need, built once by `create_app`."""

    settings: ControlPlaneSettings
    engine: Engine
    clock: Callable[[], datetime]
    heartbeats: HeartbeatService
    health: HostHealthMonitor
    metrics: ControlPlaneMetrics
    token_cache: AgentTokenCache
    registrations: RegistrationRateLimit = field(default_factory=RegistrationRateLimit)


async def get_context(request: Request) -> AppContext:
    """The app's context (async: no I/O, so no trip through the thread pool)."""
    ctx: AppContext = request.app.state.ctx
    return ctx


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_session(ctx: ContextDep) -> Iterator[Session]:
    """A session for one request; handlers commit what they change, in one transaction."""
    with Session(ctx.engine, expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def finite_numbers(request: Request) -> None:
    """422 naming the field for a JSON body with a number that is not finite, wherever it is.

    App-wide (`create_app`): it runs after FastAPI parsed the body (the parse is cached) and
    before any field is validated, so a free-form value (engine_config) is held to it too.
    """
    if "json" not in request.headers.get("content-type", "") or not await request.body():
        return
    try:
        document = await request.json()
    except ValueError:
        return  # not JSON: the route's own body parsing answers that
    path = non_finite_number(document)
    if path is not None:
        raise RequestValidationError(
            [{"type": "finite_number", "loc": ("body", *path),
              "msg": "Input should be a finite number (not NaN, Infinity or beyond 1.8e308)"}]
        )  # fmt: skip


def _authenticate(
    ctx: AppContext, secret: str, now: datetime, roles: frozenset[Role], spend: bool
) -> Principal:
    with session_scope(ctx.engine) as session:
        principal = authenticate(session, secret, now)
        # A refused request spends no use. A parallel request may have spent the last use
        # since `authenticate` read it: the conditional decrement is what decides.
        allowed = any(principal.may(role) for role in roles)
        if (
            allowed
            and spend
            and principal.limited_uses
            and not consume_use(session, principal.token_id)
        ):
            raise TokenRefused(f"token {principal.name!r} has no uses left")
    return principal


async def authorize(
    ctx: AppContext, authorization: str | None, roles: frozenset[Role], *, spend: bool = True
) -> Principal:
    """The caller behind an `Authorization` header, if its role is one of `roles`.

    Raises `ApiError` 401 (no or bad token) or 403 (role not allowed). Always checked against
    the store (in the thread pool), so a token revoked on any replica is refused at once; only
    heartbeats use the agent token cache, and their write re-checks the token itself. With
    `spend`, a token with limited uses spends one; without, the handler spends it (in the
    transaction of what it pays for) or a later check does.
    """
    try:
        secret = parse_header(authorization)
        principal = await run_in_threadpool(_authenticate, ctx, secret, ctx.clock(), roles, spend)
    except AuthError as exc:
        raise ApiError(401, "unauthorized", str(exc)) from exc
    if not any(principal.may(role) for role in roles):
        needed = " or ".join(sorted(r.value for r in roles))
        raise ApiError(
            403,
            "forbidden",
            f"this needs a token with role {needed}; "
            f"token {principal.name!r} has role {principal.role.value}",
        )
    return principal


class RoleGate:
    """Dependency that authenticates the bearer token and checks its role against `roles`.

    `spend=False` leaves spending a limited token's use to the handler (registration spends the
    bootstrap token's use only if the registration commits).
    """

    def __init__(self, *roles: Role, spend: bool = True) -> None:
        self.roles = frozenset(roles)
        self.spend = spend

    async def __call__(self, request: Request, ctx: ContextDep) -> Principal:
        """The caller, or 401 (no / bad token) or 403 (role not allowed here)."""
        return await authorize(
            ctx, request.headers.get("authorization"), self.roles, spend=self.spend
        )


Viewer = Annotated[Principal, Depends(RoleGate(Role.VIEWER))]
Operator = Annotated[Principal, Depends(RoleGate(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(RoleGate(Role.ADMIN))]
# Registration: a bootstrap token (a new host, or the one host a re-key token is bound to) or
# the host's own agent token (it registers again); the registration spends the use.
Registrant = Annotated[Principal, Depends(RoleGate(Role.BOOTSTRAP, Role.AGENT, spend=False))]
Agent = Annotated[Principal, Depends(RoleGate(Role.AGENT))]
AdminOrAgent = Annotated[Principal, Depends(RoleGate(Role.ADMIN, Role.AGENT))]
# Gateways only, not even admins: the routing table carries every engine's API key.
Gateway = Annotated[Principal, Depends(RoleGate(Role.GATEWAY))]
# A gateway holding a request for a deployment scaled to zero, or an operator, may wake it.
Waker = Annotated[Principal, Depends(RoleGate(Role.GATEWAY, Role.OPERATOR))]
