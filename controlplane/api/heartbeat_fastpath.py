"""The heartbeat's fast lane: the common case answered without FastAPI's request machinery.

A steady-state heartbeat (valid agent token without a uses limit, valid body, known host) is the
control plane's hottest request, and FastAPI's routing, dependency solving and exception
wrappers cost more CPU than the heartbeat's own work. This pure ASGI middleware answers exactly
that case itself. Anything else (bad or refused token, wrong role, bad body, removed host, a
database error) is replayed, body included, through the regular `POST
/api/v1/agents/heartbeat` route, which owns every error response; a failed attempt here wrote
nothing (its transaction rolled back), so running it again there is safe.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.deps import AppContext
from controlplane.auth import Principal, Role, authenticate, parse_authorization
from controlplane.db import session_scope
from protocol.wire import HEARTBEAT_PATH, Heartbeat

# A heartbeat of a big host is tens of KiB; past this the regular route (and its body limit)
# takes over.
MAX_FAST_BODY = 1 << 20

_JSON_HEADERS = [(b"content-type", b"application/json")]


class HeartbeatFastPath:
    """Answer cached-token, well-formed heartbeats directly; replay the rest to the app."""

    def __init__(self, app: ASGIApp, ctx: AppContext, route: Any) -> None:
        self.app = app
        self.ctx = ctx
        # Set as the scope's route so request metrics count the heartbeat under its template.
        self.route = route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Handle `POST /api/v1/agents/heartbeat` when it can be; pass everything else on."""
        if scope["type"] != "http" or scope["path"] != HEARTBEAT_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more and size <= MAX_FAST_BODY:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                break
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = message.get("more_body", False)
        reply = None if more else await self._answer(scope, b"".join(chunks))
        if reply is None:
            await self.app(scope, _replay(chunks, more, receive), send)
            return
        scope["route"] = self.route
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(reply)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": reply})

    async def _answer(self, scope: Scope, body: bytes) -> bytes | None:
        """The reply, or None when the regular route must answer (an error, a limited token)."""
        ctx = self.ctx
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            beat = Heartbeat.model_validate_json(body)
            secret = parse_authorization(header)
            now = ctx.clock()
            principal = ctx.token_cache.get(secret, now)
            if principal is None:
                # Every agent's cache entry expires every few seconds; verifying it here
                # (on the heartbeat writer, so SQLite never makes it wait on a busy lock)
                # spares a fleet a trip through the full route for each of them.
                principal = await ctx.heartbeats.run_on_writer(_verify, ctx, secret, now)
                if principal.limited_uses:
                    return None  # the route spends the use, exactly once
                ctx.token_cache.put(secret, principal, now)
        except Exception:  # a bad body or token, or a failed lookup: the route answers it
            return None
        if principal.host_id is None or not principal.may(Role.AGENT):
            return None
        try:
            return await ctx.heartbeats.submit(
                principal.host_id, beat, lambda: str(Request(scope).base_url)
            )
        except Exception:  # the regular route runs it again and maps the error to a reply
            return None


def _verify(ctx: AppContext, secret: str, now: datetime) -> Principal:
    """The token's principal from the store (AuthError when refused); spends no use."""
    with session_scope(ctx.engine) as session:
        return authenticate(session, secret, now)


def _replay(chunks: list[bytes], more: bool, receive: Receive) -> Receive:
    """A `receive` that hands out the body already read, then continues with the real one."""
    pending = list(chunks)

    async def replay() -> Message:
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending) or more}
        return await receive()

    return replay
