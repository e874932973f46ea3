"""Request bodies under a size limit, and clients that leave: the ASGI side of every dctl server.

The gateway (a bare ASGI app), the engine's server and the control plane (FastAPI) all read
bodies whose size the client chooses, so all of them refuse one the moment it is known to be too
large: up front when its `content-length` says so, else while it arrives, the rest never read.
A client that disconnects first gets no answer; servers log and count it as 499 (nginx's "client
closed request"). Each server turns `BodyTooLarge` and `ClientGone` into its own error shape.

Only the ASGI message protocol (a `receive` callable handing out dicts), no framework.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

# nginx's code for "the client closed the request first": no client sees it, logs and metrics do.
CLIENT_CLOSED_REQUEST = 499


class BodyTooLarge(Exception):
    """The request body is larger than `limit` bytes (answer 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


class ClientGone(Exception):
    """The client disconnected before its request was read."""


def declared_too_large(declared: bytes | str | None, limit: int) -> bool:
    """Whether a `content-length` header value announces more than LIMIT bytes.

    A missing or malformed value announces nothing: the body is counted as it arrives instead.
    """
    return declared is not None and declared.isdigit() and int(declared) > limit


def bounded(receive: Receive, limit: int, too_large: Callable[[], Exception]) -> Receive:
    """RECEIVE, counting body bytes: the message that takes them past LIMIT raises `too_large()`.

    For a body read by someone else (a framework behind a middleware): what passes the limit is
    never handed on, and nothing after it is read.
    """
    received = 0

    async def receive_bounded() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise too_large()
        return message

    return receive_bounded


async def read_body(receive: Receive, declared: bytes | str | None, limit: int) -> bytes:
    """The whole request body, at most LIMIT bytes; DECLARED is its `content-length` header.

    Raises `BodyTooLarge` as soon as the body is known to exceed LIMIT (before reading when
    DECLARED says so) and `ClientGone` when the client disconnects first.
    """
    if declared_too_large(declared, limit):
        raise BodyTooLarge(limit)
    receive = bounded(receive, limit, lambda: BodyTooLarge(limit))
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        if chunk:
            parts.append(chunk)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def until_disconnected(receive: Receive) -> None:
    """Return once the client has disconnected; for a task that owns RECEIVE after the body.

    Servers drop writes to a closed connection silently, so reading the channel is the exact way
    to notice a client that left while its response is being made.
    """
    while (await receive())["type"] != "http.disconnect":
        pass
