"""Request dependencies: the app context, a database session, and the calling token's role."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session
from starlette.concurrency import run_in_threadpool

from controlplane.api.errors import ApiError
from controlplane.auth import (
    AgentTokenCache,
    AuthError,
    Principal,
    Role,
    authenticate,
    consume_use,
)
from controlplane.auth import parse_authorization as parse_header
from controlplane.db import session_scope
from controlplane.heartbeats import HeartbeatService
from controlplane.hosthealth import HostHealthMonitor
from controlplane.metrics import ControlPlaneMetrics
from controlplane.settings import ControlPlaneSettings


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


def _authenticate(ctx: AppContext, secret: str, now: datetime, roles: frozenset[Role]) -> Principal:
    with session_scope(ctx.engine) as session:
        principal = authenticate(session, secret, now)
        # A refused request spends no use; bootstrap tokens spend one only when a
        # registration commits.
        allowed = any(principal.may(role) for role in roles)
        if allowed and principal.limited_uses and principal.role != Role.BOOTSTRAP:
            consume_use(session, principal.token_id)
    return principal


class RoleGate:
    """Dependency that authenticates the bearer token and checks its role against `roles`."""

    def __init__(self, *roles: Role) -> None:
        self.roles = frozenset(roles)

    async def __call__(self, request: Request, ctx: ContextDep) -> Principal:
        """The caller, or 401 (no / bad token) or 403 (role not allowed here).

        Always checked against the store (in the thread pool), so a token revoked on any
        replica is refused at once; only heartbeats use the agent token cache, and their write
        re-checks the token itself.
        """
        try:
            secret = parse_header(request.headers.get("authorization"))
            principal = await run_in_threadpool(_authenticate, ctx, secret, ctx.clock(), self.roles)
        except AuthError as exc:
            raise ApiError(401, "unauthorized", str(exc)) from exc
        if not any(principal.may(role) for role in self.roles):
            needed = " or ".join(sorted(r.value for r in self.roles))
            raise ApiError(
                403,
                "forbidden",
                f"this needs a token with role {needed}; "
                f"token {principal.name!r} has role {principal.role.value}",
            )
        return principal


Viewer = Annotated[Principal, Depends(RoleGate(Role.VIEWER))]
Operator = Annotated[Principal, Depends(RoleGate(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(RoleGate(Role.ADMIN))]
Bootstrap = Annotated[Principal, Depends(RoleGate(Role.BOOTSTRAP))]
Agent = Annotated[Principal, Depends(RoleGate(Role.AGENT))]
ViewerOrAgent = Annotated[Principal, Depends(RoleGate(Role.VIEWER, Role.AGENT))]
