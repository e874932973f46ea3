"""The heartbeat's fast lane: the common case answered without FastAPI's request machinery.

A heartbeat is the control plane's hottest request, and FastAPI's routing, dependency solving
and exception wrappers cost more CPU than the heartbeat's own work. This pure ASGI middleware
runs the one heartbeat implementation (`HeartbeatService.answer`: token, body, write, reply)
itself and sends the reply. Whatever that raises (bad or refused token, wrong role, bad body,
removed host, a database error) is replayed, body included, through the regular `POST
/api/v1/agents/heartbeat` route, which runs the same call again and owns every error response;
a failed attempt wrote nothing (its transaction rolled back), so running it again is safe.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.deps import AppContext
from protocol.wire import HEARTBEAT_PATH

# A heartbeat of a big host is tens of KiB; past this the regular route (and its body limit)
# takes over.
MAX_FAST_BODY = 1 << 20

_JSON_HEADERS = [(b"content-type", b"application/json")]


class HeartbeatFastPath:
    """Answer heartbeats directly; replay the ones that fail to the app, for its error reply."""

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
        """The reply, or None when the regular route must answer (with an error)."""
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            return await self.ctx.heartbeats.answer(header, body)
        except Exception:  # the regular route runs it again and maps the error to a reply
            return None


def _replay(chunks: list[bytes], more: bool, receive: Receive) -> Receive:
    """A `receive` that hands out the body already read, then continues with the real one."""
    pending = list(chunks)

    async def replay() -> Message:
        if pending:
            body = pending.pop(0)
            return {"type": "http.request", "body": body, "more_body": bool(pending) or more}
        return await receive()

    return replay
