"""One log line per API request, tied together by `x-request-id` with the gateway's line.

The gateway passes its request id (the client's, or one it made) as `x-request-id`; the engine
logs it and echoes it, so one grep finds a request in both logs. A request without a usable id
gets a fresh one. Ids are a bounded, log-safe alphabet: a client must not inject log lines or
megabytes into them.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protocol.logs import REQUEST_ID_PATTERN

log = logging.getLogger("engine.requests")

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN.encode())
HEADER = b"x-request-id"


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's `x-request-id` when it is a sane token, else a new one."""
    for name, value in headers:
        if name == HEADER and _REQUEST_ID.fullmatch(value):
            return value.decode("ascii")
    return uuid.uuid4().hex


class RequestLog:
    """ASGI middleware: echo `x-request-id` and log method, path, status and duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope["headers"])
        start = time.perf_counter()
        status: dict[str, Any] = {"code": 500}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message["headers"] = [*message.get("headers", []), (HEADER, request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log.info(
                "request",
                extra={
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status["code"],
                    "seconds": round(time.perf_counter() - start, 4),
                },
            )
