"""Request body limits, applied before the body is read (pure ASGI middleware).

Every request body is bounded: `ORDINARY_BODY_LIMIT` for most routes (their JSON is a few KiB),
`HEARTBEAT_BODY_LIMIT` for heartbeats (a host with 8 GPUs and its instances sends a few KiB, a
big one tens of KiB), `TRAFFIC_BODY_LIMIT` for gateways' traffic reports and
`MANIFEST_BODY_LIMIT` for registering a model version, whose manifest may list 100,000 files
(measured: 16 MiB with 40-character paths, 31 MiB with 200-character ones). A Content-Length
over the limit is answered 413 at once, nothing read; a chunked body is counted as it arrives
and refused the moment it passes the limit, the rest never read.

Only a caller the route would accept may send more than the ordinary limit: for a route with a
bigger one, the token is checked with the route's own role gate (`deps.authorize`, no use
spent: the route spends it) before the first byte of the body is read. So an anonymous client
can make the control plane buffer at most `ORDINARY_BODY_LIMIT` per request.

Starlette's `RequestBodyLimitMiddleware` does the counting too, but answers in plain text,
cannot check a token first, and does not reach the heartbeat lane, which answers before routing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.deps import AppContext, RoleGate, authorize
from controlplane.api.errors import ApiError, error_response
from controlplane.auth import Role
from protocol.wire import HEARTBEAT_PATH
from runtime.asgi_body import bounded

ORDINARY_BODY_LIMIT = 1 << 20
HEARTBEAT_BODY_LIMIT = 1 << 20
MANIFEST_BODY_LIMIT = 64 << 20
# A gateway's traffic report: up to 4096 windows of about 600 bytes of JSON each.
TRAFFIC_BODY_LIMIT = 4 << 20


@dataclass(frozen=True)
class RouteBodyLimit:
    """A route (method and path template, as routed) whose body may be bigger or smaller."""

    method: str
    template: str
    limit: int


BODY_LIMITS = (
    RouteBodyLimit("POST", HEARTBEAT_PATH, HEARTBEAT_BODY_LIMIT),
    RouteBodyLimit("POST", "/api/v1/models/{name}/versions", MANIFEST_BODY_LIMIT),
    RouteBodyLimit("POST", "/api/v1/traffic", TRAFFIC_BODY_LIMIT),
)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n} bytes"


class RouteBodyTooLarge(HTTPException):
    """The body passed its route's limit while being read (413; the connection is closed after).

    An `HTTPException`, so FastAPI lets it through its body parsing to the error handlers
    unchanged (it turns any other exception there into a 400): hence not
    `runtime.asgi_body.BodyTooLarge`. Outside FastAPI (the heartbeat lane) the middleware
    answers it.
    """

    def __init__(self, where: str, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than {_size(limit)} ({limit} bytes), the limit for "
            f"{where}: send less",
            headers={"Connection": "close"},
        )


@dataclass(frozen=True)
class _Rule:
    method: str
    template: str
    limit: int
    path: re.Pattern[str] | None  # None: the template has no parameters, compare it as is
    roles: frozenset[Role] | None  # checked before reading past the ordinary limit


def _role_gate(route: APIRoute) -> frozenset[Role] | None:
    """The roles of the route's `RoleGate` dependency, if it has one."""
    pending = list(route.dependant.dependencies)
    while pending:
        dependency = pending.pop()
        if isinstance(dependency.call, RoleGate):
            return dependency.call.roles
        pending.extend(dependency.dependencies)
    return None


def _rules(routes: Iterable[BaseRoute], limits: Sequence[RouteBodyLimit]) -> list[_Rule]:
    rules = []
    for wanted in limits:
        route = next(
            (
                r
                for r in routes
                if isinstance(r, APIRoute)
                and r.path == wanted.template
                and wanted.method in (r.methods or ())
            ),
            None,
        )
        if route is None:
            raise ValueError(f"no route {wanted.method} {wanted.template} to limit")
        rules.append(
            _Rule(
                wanted.method,
                wanted.template,
                wanted.limit,
                None if "{" not in wanted.template else route.path_regex,
                _role_gate(route),
            )
        )
    return rules


class RequestBodyLimit:
    """Refuse bodies over their route's limit (413), checking the token first for big ones."""

    def __init__(
        self,
        app: ASGIApp,
        ctx: AppContext,
        routes: Iterable[BaseRoute],
        limits: Sequence[RouteBodyLimit] = BODY_LIMITS,
        default: int = ORDINARY_BODY_LIMIT,
    ) -> None:
        self.app = app
        self.ctx = ctx
        self.default = default
        self.rules = _rules(routes, limits)

    def _rule(self, method: str, path: str) -> _Rule | None:
        for rule in self.rules:
            if rule.method == method and (
                path == rule.template if rule.path is None else rule.path.match(path)
            ):
                return rule
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on with its body bounded, or answer 413 / 401 / 403 first."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        chunked = False
        authorization = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                declared = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"authorization":
                authorization = value.decode("latin-1")
        if declared is None and not chunked:
            await self.app(scope, receive, send)  # no body
            return
        rule = self._rule(scope["method"], scope["path"])
        limit = self.default if rule is None else rule.limit
        where = f"{scope['method']} {scope['path'] if rule is None else rule.template}"
        if declared is not None and declared > limit:
            await _refuse(RouteBodyTooLarge(where, limit), scope, receive, send)
            return
        if (
            rule is not None
            and rule.roles is not None
            and limit > self.default
            and (declared is None or declared > self.default)
        ):
            try:
                await authorize(self.ctx, authorization, rule.roles, spend=False)
            except ApiError as exc:
                await error_response(exc)(scope, receive, send)
                return
        if declared is not None:
            # The server reads exactly Content-Length bytes: nothing more can arrive.
            await self.app(scope, receive, send)
            return
        await self._counted(scope, receive, send, where, limit)

    async def _counted(
        self, scope: Scope, receive: Receive, send: Send, where: str, limit: int
    ) -> None:
        """Pass a chunked body on, counting it; past `limit` reading stops with a 413."""
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            limited = bounded(receive, limit, lambda: RouteBodyTooLarge(where, limit))
            await self.app(scope, limited, send_tracked)
        except RouteBodyTooLarge as exc:
            if started:
                raise
            await _refuse(exc, scope, receive, send)


async def _refuse(exc: RouteBodyTooLarge, scope: Scope, receive: Receive, send: Send) -> None:
    error = ApiError(413, "payload_too_large", exc.detail, headers=dict(exc.headers or {}))
    await error_response(error)(scope, receive, send)
