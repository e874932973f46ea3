"""What every request passes before a route reads it: the API key, then a bounded body.

Both take anything a client can put in headers and body (any bytes, lying lengths, a body that
never ends) and answer with an `OpenAIErrorReply` in the OpenAI shape, never with a 500.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from protocol.openai import OpenAIErrorReply
from runtime import asgi_body


def authorize(request: Request, api_key: str | None) -> None:
    """Refuse (401) a request without `Authorization: Bearer <api_key>`; no key: all pass."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Bytes, not str: compare_digest refuses non-ASCII text, and a header may hold any byte
    # (Starlette decodes headers as latin-1, which gives the bytes back exactly).
    sent = token.strip().encode("latin-1")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent, api_key.encode("utf-8")):
        raise OpenAIErrorReply(
            401,
            "missing or wrong API key; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body; a 413 as soon as it is known to exceed `max_bytes`, before parsing."""
    # No `Connection: close`: uvicorn discards the unread rest of the body (it never reaches us),
    # so a client still sending sees this answer instead of a reset connection.
    declared = request.headers.get("content-length")
    try:
        return await asgi_body.read_body(request.receive, declared, max_bytes)
    except asgi_body.BodyTooLarge:
        raise OpenAIErrorReply(
            413,
            f"the request body exceeds {max_bytes} bytes (service.max_body_bytes); send less",
            code="request_too_large",
        ) from None
    except asgi_body.ClientGone:
        # The client left mid-body (or sent less than its Content-Length): no answer can reach
        # it, and it is no engine error.
        raise client_gone() from None


def client_gone() -> OpenAIErrorReply:
    """What a request whose client left answers (no one reads it; logs and metrics do)."""
    return OpenAIErrorReply(
        asgi_body.CLIENT_CLOSED_REQUEST, "the client closed the request", code="client_gone"
    )
