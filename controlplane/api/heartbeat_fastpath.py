"""The heartbeat's fast lane: the common case answered without FastAPI's request machinery.

A heartbeat is the control plane's hottest request, and FastAPI's routing, dependency solving
and exception wrappers cost more CPU than the heartbeat's own work. This pure ASGI middleware
runs the one heartbeat implementation (`HeartbeatService.answer`: token, body, write, reply)
itself and sends the reply. Whatever that raises (bad or refused token, wrong role, too fast,
bad body, removed host, a database error) is handed, with the request, to the regular `POST
/api/v1/agents/heartbeat` route (under `FAST_PATH_ERROR` in the scope), which owns every error
response and raises it again rather than run the heartbeat twice: a flood of bad heartbeats
costs one token check each, not two. The body is replayed too, for a request this lane did not
read to the end.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.body_limit import HEARTBEAT_BODY_LIMIT
from controlplane.api.deps import AppContext
from protocol.wire import HEARTBEAT_PATH

# A heartbeat of a big host is tens of KiB; the body limit (api/body_limit.py) stops anything
# past this before it gets here.
MAX_FAST_BODY = HEARTBEAT_BODY_LIMIT
# The scope key under which the route finds what this lane's attempt raised.
FAST_PATH_ERROR = "dctl.heartbeat_error"

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
        """The reply, or None when the regular route must answer (with the error it finds)."""
        header = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            return await self.ctx.heartbeats.answer(header, body)
        except Exception as exc:  # the regular route maps it to the error reply
            scope[FAST_PATH_ERROR] = exc
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
