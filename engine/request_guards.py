"""What every request passes before a route reads it: the API key, then a bounded body.

Both take anything a client can put in headers and body (any bytes, lying lengths, a body that
never ends) and answer with an `ApiError` in the OpenAI shape, never with a 500.
"""

from __future__ import annotations

import hmac

from fastapi import Request
from starlette.requests import ClientDisconnect

from protocol.openai import ApiError


def authorize(request: Request, api_key: str | None) -> None:
    """Refuse (401) a request without `Authorization: Bearer <api_key>`; no key: all pass."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII text, and a header may hold any byte
    # (Starlette decodes headers as latin-1, which gives the bytes back exactly).
    sent = token.strip().encode("latin-1")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, api_key.encode("utf-8")):
        raise ApiError(
            401,
            "missing or wrong API key; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body; a 413 as soon as it is known to exceed `max_bytes`, before parsing."""
    too_large = ApiError(
        413,
        f"the request body exceeds {max_bytes} bytes (service.max_body_bytes); send less",
        code="request_too_large",
    )
    # No `Connection: close`: uvicorn discards the unread rest of the body (it never reaches us),
    # so a client still sending sees this answer instead of a reset connection.
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        # The client left mid-body (or sent less than its Content-Length): no answer can reach
        # it, and it is no engine error.
        raise ApiError(499, "the client closed the request", code="client_gone") from None
    return b"".join(chunks)
