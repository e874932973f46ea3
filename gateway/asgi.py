"""The few ASGI pieces the gateway's plain app needs: headers in, JSON out.

The gateway is a bare ASGI callable under uvicorn (no framework): on a path that only moves
bytes, a framework's request and response objects would be most of the cost. Bodies are read under
their limit by `runtime.asgi_body`, as in every dctl server.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from protocol.openai import OpenAIErrorReply

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"


def header_map(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by lower-case name (the last one wins for a repeated name)."""
    return dict(scope["headers"])  # uvicorn gives names lower-cased


async def send_json(send: Send, status: int, payload: Any, headers: Headers | None = None) -> None:
    """One whole JSON response."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    await send_bytes(send, status, body, JSON, headers)


async def send_bytes(
    send: Send, status: int, body: bytes, content_type: bytes, headers: Headers | None = None
) -> None:
    """One whole response of BODY."""
    out: Headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        out += headers
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: OpenAIErrorReply, request_id: bytes | None = None) -> None:
    """ERROR in OpenAI's shape, with its headers (`Retry-After`) and the request id."""
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers.items()]
    if request_id is not None:
        headers.append((b"x-request-id", request_id))
    await send_json(send, error.status, error.body(), headers)
