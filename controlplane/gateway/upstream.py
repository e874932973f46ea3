"""The gateway's HTTP/1.1 client for engines: keep-alive connections over asyncio streams, with
responses parsed by httptools and handed on chunk by chunk as they arrive.

Why not httpx: on the request path every microsecond is the gateway's overhead, and a general
client spends hundreds of them per request; this one does only what an engine exchange needs
(one request, then a response framed by content-length, chunked encoding or the connection's
end), at a few microseconds.

A connection goes back to the idle list only after a complete response that did not ask to close
it; idle lists are capped per engine and idle connections older than `IDLE_TTL_S` are dropped
(engines close theirs after a few seconds). A reused connection that turns out to be closed
before any response byte arrives is replaced by a new one, once, without counting as a failure.
Each exchange has one deadline (`timeout_s`) for everything after connecting; a timer aborts the
connection when it passes.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field

import httptools

Target = tuple[str, str, int]  # scheme, address, port

IDLE_PER_TARGET = 64
IDLE_TTL_S = 4.0
_READ_SIZE = 65536


class UpstreamError(Exception):
    """An exchange with an engine failed. `answered`: a response head had arrived."""

    answered = False


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, timed out, TLS refused)."""


class ExchangeBroken(UpstreamError):
    """The connection ended or sent something that is not HTTP before the response was whole."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class ExchangeTimeout(UpstreamError):
    """The engine did not finish its answer within the exchange's deadline."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class _StaleConnection(Exception):
    """A reused connection was closed by the engine before it read the request."""


@dataclass(eq=False)
class _Connection:
    target: Target
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = field(default=0.0)

    def usable(self, now: float) -> bool:
        return (
            not self.writer.transport.is_closing()
            and not self.reader.at_eof()
            and now - self.idle_since < IDLE_TTL_S
        )

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.transport.abort()


class Exchange:
    """One request on one connection and the response to it.

    `status` and `headers` are there once `UpstreamPool.send` returns; the body comes from
    `next_chunk()` as it arrives. `release()` ends the exchange: the connection goes back to the
    pool after a complete response, and is closed otherwise (so an engine whose answer is cut
    short sees its client leave, and cancels the request).
    """

    def __init__(self, pool: UpstreamPool, conn: _Connection, deadline: float) -> None:
        self._pool = pool
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._received = 0
        self._messages = 0
        self._framed = False  # content-length or chunked: the body's end is not the connection's
        self.head_complete = False
        self.complete = False
        self._keep_alive = False
        self.timed_out = False
        self._released = False
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        self._messages += 1

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (
            lower == b"transfer-encoding" and b"chunked" in value.lower()
        ):
            self._framed = True
        self.headers.append((lower, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_complete = True

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # --- reading ---

    async def _feed(self) -> None:
        try:
            data = await self._conn.reader.read(_READ_SIZE)
        except OSError:
            data = b""
        if not data:
            self._ended()
            return
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete:  # bytes after the response: answered, but not reusable
                self._messages += 1
                return
            raise ExchangeBroken(
                f"engine sent something that is not HTTP: {exc}", answered=self.head_complete
            ) from None
        if self._messages > 1:
            self._keep_alive = False

    def _ended(self) -> None:
        """The connection ended before the response was complete."""
        if self.timed_out:
            raise ExchangeTimeout(
                f"engine did not finish answering within {self._pool.timeout_s:g} s",
                answered=self.head_complete,
            )
        if self.head_complete and not self._framed:
            self.complete = True  # a body that ends with the connection
            self._keep_alive = False
            return
        raise ExchangeBroken(
            "engine closed the connection " + ("mid-body" if self.head_complete else "unanswered"),
            answered=self.head_complete,
        )

    async def _read_head(self) -> None:
        # No 1xx answer to skip: engines are sent no `Expect`.
        while not self.head_complete:
            await self._feed()

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some); None at the end."""
        while not self._body:
            if self.complete:
                return None
            await self._feed()
        chunk = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        return chunk

    # --- ending ---

    def _expire(self) -> None:
        if not self.complete:
            self.timed_out = True
            self._conn.abort()

    def release(self) -> None:
        """End the exchange: keep the connection for the next one if the response was complete
        and nothing said to close it, else close it. Idempotent."""
        if self._released:
            return
        self._released = True
        self._timer.cancel()
        if self.complete and self._keep_alive and not self.timed_out:
            self._pool._put_idle(self._conn)
        else:
            self._conn.close()


class UpstreamPool:
    """Keep-alive connections to engines, per (scheme, address, port)."""

    def __init__(
        self,
        *,
        connect_timeout_s: float,
        timeout_s: float,
        tls: ssl.SSLContext | None = None,
        idle_per_target: int = IDLE_PER_TARGET,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.timeout_s = timeout_s
        self._tls = tls
        self._idle_per_target = idle_per_target
        self._idle: dict[Target, list[_Connection]] = {}

    async def send(self, target: Target, head: bytes, body: bytes) -> Exchange:
        """Send one request (HEAD: the request line and headers, ending in an empty line) and
        return once the response head has arrived. Raises `UpstreamError`."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        conn = self._take_idle(target)
        if conn is not None:
            try:
                return await self._exchange(conn, deadline, head, body, reused=True)
            except _StaleConnection:
                pass
        conn = await self._connect(target)
        return await self._exchange(conn, deadline, head, body, reused=False)

    async def _exchange(
        self, conn: _Connection, deadline: float, head: bytes, body: bytes, *, reused: bool
    ) -> Exchange:
        exchange = Exchange(self, conn, deadline)
        try:
            writer = conn.writer
            if len(body) < _READ_SIZE:
                writer.write(head + body)
            else:
                writer.write(head)
                writer.write(body)
            try:
                await writer.drain()
            except OSError:
                exchange._ended()  # raises the right error
            await exchange._read_head()
        except ExchangeBroken as exc:
            exchange.release()
            if reused and not exc.answered and exchange._received == 0:
                raise _StaleConnection from None
            raise
        except BaseException:
            exchange.release()  # timeouts, cancellation: the connection is closed
            raise
        return exchange

    async def _connect(self, target: Target) -> _Connection:
        scheme, address, port = target
        tls = None
        if scheme == "https":
            tls = self._tls or ssl.create_default_context()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    address, port, ssl=tls, server_hostname=address if tls else None
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise ConnectFailed(
                f"cannot connect to {scheme}://{address}:{port}: no answer within "
                f"{self.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:  # refused, unreachable, name unknown, TLS refused
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise ConnectFailed(
                f"cannot connect to {scheme}://{address}:{port}: {reason}"
            ) from None
        return _Connection(target, reader, writer)

    def _take_idle(self, target: Target) -> _Connection | None:
        idle = self._idle.get(target)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                return conn
            conn.close()
        return None

    def _put_idle(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.target, [])
        if len(idle) >= self._idle_per_target:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def idle_count(self, target: Target) -> int:
        """Idle connections kept for TARGET."""
        return len(self._idle.get(target, ()))

    def retain(self, targets: set[Target]) -> None:
        """Close the idle connections of engines that are no longer in the routing table."""
        for target in [t for t in self._idle if t not in targets]:
            for conn in self._idle.pop(target):
                conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
