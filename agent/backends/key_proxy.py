"""The key-checking proxy in front of an engine that cannot check API keys itself.

Such an engine listens on loopback only; this ASGI app listens on the instance's address and
port, refuses a request without `Authorization: Bearer <the instance's key>` (401, as the dctl
engine does) and forwards the rest as they come, bodies and answers streamed (server-sent events
pass through chunk by chunk). Probe and metrics paths pass without a key, as the dctl engine
serves them, so the agent, the gateway and Prometheus reach them unchanged. An engine that does
not answer (still loading, draining, gone) is a 503, which the gateway retries elsewhere.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx

log = logging.getLogger("dctl.agent.key_proxy")
# Connection-level headers (RFC 9110 7.6.1): each hop sets its own.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
     b"trailer", b"transfer-encoding", b"upgrade", b"host"}
)  # fmt: skip
Scope = dict[str, Any]
Message = dict[str, Any]


def error_body(message: str, code: str) -> bytes:
    """An OpenAI-style error body."""
    error = {"message": message, "type": "invalid_request_error", "code": code}
    return json.dumps({"error": error}).encode()


class KeyCheckingProxy:
    """ASGI: check the key, then forward to UPSTREAM (`http://127.0.0.1:PORT`)."""

    def __init__(self, upstream: str, api_key: str | None, open_paths: Iterable[str]) -> None:
        self._key = api_key.encode() if api_key is not None else None
        self._open = frozenset(open_paths)
        # No read timeout: a long generation streams for as long as it takes; the gateway and
        # the client hold the deadlines. No idle connection is kept to the engine: a server
        # draining on its signal waits for its open connections (Sanic 15 s), and a new one on
        # loopback costs next to nothing.
        self._client = httpx.AsyncClient(
            base_url=upstream,
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = [(k.lower(), v) for k, v in scope["headers"]]
        if scope["path"] not in self._open and not self._authorized(headers):
            await _answer(
                send, 401, error_body(
                    "missing or wrong API key; send 'Authorization: Bearer <key>'",
                    "invalid_api_key",
                ),
            )  # fmt: skip
            return
        await self._forward(scope, receive, send, headers)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self._key is None:
            return True
        sent = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = sent.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)

    async def _forward(
        self, scope: Scope, receive: Any, send: Any, headers: list[tuple[bytes, bytes]]
    ) -> None:
        query = scope.get("query_string", b"")
        target = scope.get("raw_path") or scope["path"].encode()
        url = target.decode("latin-1") + (f"?{query.decode('latin-1')}" if query else "")
        upstream_headers = [(k, v) for k, v in headers if k not in HOP_BY_HOP]
        has_body = any(k in (b"content-length", b"transfer-encoding") for k, _ in headers)
        request = self._client.build_request(
            scope["method"], url, headers=upstream_headers,
            content=_body(receive) if has_body else None,
        )  # fmt: skip
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            log.info("engine not answering %s %s: %s", scope["method"], scope["path"], exc)
            body = error_body("the engine is not answering (starting or stopping)", "unavailable")
            await _answer(send, 503, body)
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP
                    ],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError as exc:  # the engine broke off mid-answer: so does the client's
            log.info("engine broke off %s %s: %s", scope["method"], scope["path"], exc)
        finally:
            await response.aclose()

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _body(receive: Any) -> AsyncIterator[bytes]:
    """The request body as it arrives."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        if chunk:
            yield chunk
        if not message.get("more_body", False):
            return


async def _answer(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
