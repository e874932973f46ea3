"""Deadlines on each client connection, below the app: uvicorn's httptools protocol with the
timers it lacks.

uvicorn closes a keep-alive connection that stays idle `timeout_keep_alive` after a response,
but it starts no timer on a new connection, and none while a request's head or body trickles
in: a client that connects and sends nothing, sends half a head, or declares a body and never
sends it keeps its connection (and, once its head is complete, an in-flight slot) as long as it
likes. `DeadlineProtocol` adds, per connection:

    accepted                     --min(idle_s, head_s), no byte--> closed
    an answer sent               --idle_s without a byte-->        closed
    first byte of a request head --head_s, head incomplete-->      408, closed
    head complete                --body_s, body incomplete-->      closed once the answer is out

The app answers 408 itself for a body it waits for (`GatewayApp`, the same `body_s`), so the
body timer here only ends connections whose answer went out before their body came in (a
refusal sent before the body was read), which would otherwise stay open for as long as the
client trickles bytes. Only this module knows uvicorn's protocol internals.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.errors import GatewayError


@dataclass(frozen=True)
class Deadlines:
    """How long a client connection may take over each part of a request (seconds)."""

    idle_s: float  # between requests (before the first one: at most head_s)
    head_s: float  # from a head's first byte to its end
    body_s: float  # from a head's end to the end of its body


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with request-head, body and first-idle deadlines; made for
    a set of `Deadlines` by `protocol_for`."""

    deadlines: ClassVar[Deadlines]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.deadlines.idle_s  # type: ignore[assignment]  # a float
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn's idle timer, armed as uvicorn arms it after an answer (its first byte stops
        # it); a connection that has sent nothing yet gets no longer than a head would.
        first_byte_s = min(self.deadlines.idle_s, self.deadlines.head_s)
        self.timeout_keep_alive_task = self.loop.call_later(
            first_byte_s, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timers()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_timer = self.loop.call_later(self.deadlines.head_s, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._stop_timers()
        super().on_headers_complete()
        self._body_timer = self.loop.call_later(self.deadlines.body_s, self._body_timed_out)

    def on_message_complete(self) -> None:
        self._stop_timers()
        super().on_message_complete()

    def _stop_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # A pipelined head trickles in behind an answer still going out: let that answer
            # finish, then close instead of reading on.
            cycle.keep_alive = False
            return
        self.transport.write(_request_timeout(self.deadlines.head_s))
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or self.transport.is_closing():
            return
        if cycle.response_complete:
            self.transport.close()
        else:
            cycle.keep_alive = False  # the app is answering (408 when it waits for the body)


def protocol_for(deadlines: Deadlines) -> type[DeadlineProtocol]:
    """`DeadlineProtocol` for DEADLINES, as uvicorn wants it: a class (`Config(http=...)`)."""
    return cast(
        type[DeadlineProtocol],
        type("DeadlineProtocol", (DeadlineProtocol,), {"deadlines": deadlines}),
    )


def _request_timeout(head_s: float) -> bytes:
    """The whole 408 answer to a head that did not arrive in time, in OpenAI's error shape."""
    error = GatewayError(
        408,
        f"the request head (request line and headers) did not arrive within {head_s:g} s "
        "(head_timeout_s); send it at once",
        code="request_timeout",
    )
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
    )
