"""The gateway's HTTP/1.1 client for engines: keep-alive connections as asyncio protocols, with
responses parsed by httptools as bytes arrive and handed on chunk by chunk.

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
from typing import cast

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


class _Connection(asyncio.Protocol):
    """One engine connection: bytes that arrive go straight to the exchange it serves (no
    stream buffer in between); bytes that arrive while it is idle make it unusable."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.idle_since = 0.0
        self.lost = False
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.exchange is not None:
            self.exchange._feed(data)
        else:  # an idle connection has nothing to say: it cannot be trusted with a request
            self.abort()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._wake_writer()
        if self.exchange is not None:
            self.exchange._lost()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait until the request is written out (or the connection is gone)."""
        if self._write_paused and not self.lost:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def usable(self, now: float) -> bool:
        assert self.transport is not None
        return (
            not self.lost and not self.transport.is_closing() and now - self.idle_since < IDLE_TTL_S
        )

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Exchange:
    """One request on one connection and the response to it.

    `status` and `headers` are there once `UpstreamPool.send` returns; the body comes from
    `next_chunk()` as it arrives. `release()` ends the exchange: the connection goes back to the
    pool after a complete response, and is closed otherwise (so an engine whose answer is cut
    short sees its client leave, and cancels the request). While more than `_READ_SIZE` body
    bytes wait for `next_chunk()` the connection stops reading, so a slow client holds the
    engine back instead of filling the gateway's memory.
    """

    def __init__(self, pool: UpstreamPool, conn: _Connection, deadline: float) -> None:
        self._pool = pool
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._buffered = 0
        self._reading_paused = False
        self._received = 0
        self._messages = 0
        self._framed = False  # content-length or chunked: the body's end is not the connection's
        self.head_complete = False
        self.complete = False
        self._keep_alive = False
        self.timed_out = False
        self._released = False
        self._failure: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._timer = loop.call_at(deadline, self._expire)
        conn.exchange = self

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
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # --- the connection's events ---

    def _feed(self, data: bytes) -> None:
        self._received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete:  # bytes after the response: answered, but not reusable
                self._messages += 1
            elif self._failure is None:
                self._failure = ExchangeBroken(
                    f"engine sent something that is not HTTP: {exc}", answered=self.head_complete
                )
                self._conn.abort()
        if self._messages > 1:
            self._keep_alive = False
        if self._buffered > _READ_SIZE and not self._reading_paused and not self.complete:
            self._reading_paused = True
            assert self._conn.transport is not None
            self._conn.transport.pause_reading()
        self._wake()

    def _lost(self) -> None:
        """The connection ended: complete a body that ends with it, else fail the exchange."""
        if not self.complete and self._failure is None:
            if self.timed_out:
                self._failure = ExchangeTimeout(
                    f"engine did not finish answering within {self._pool.timeout_s:g} s",
                    answered=self.head_complete,
                )
            elif self.head_complete and not self._framed:
                self.complete = True  # a body that ends with the connection
                self._keep_alive = False
            else:
                self._failure = ExchangeBroken(
                    "engine closed the connection "
                    + ("mid-body" if self.head_complete else "unanswered"),
                    answered=self.head_complete,
                )
        self._keep_alive = False
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # --- reading ---

    async def _read_head(self) -> None:
        # No 1xx answer to skip: engines are sent no `Expect`.
        while not self.head_complete:
            if self._failure is not None:
                raise self._failure
            self._waiter = waiter = self._loop.create_future()
            await waiter

    async def next_chunk(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some); None at the end."""
        while not self._body:
            if self.complete:
                return None
            if self._failure is not None:
                raise self._failure
            self._waiter = waiter = self._loop.create_future()
            await waiter  # inline, not a helper coroutine: this runs once per chunk
        body = self._body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._reading_paused:
            self._reading_paused = False
            assert self._conn.transport is not None
            self._conn.transport.resume_reading()
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
        conn = self._conn
        conn.exchange = None
        if self.complete and self._keep_alive and not self.timed_out and not conn.lost:
            if self._reading_paused:
                self._reading_paused = False
                assert conn.transport is not None
                conn.transport.resume_reading()
            self._pool._put_idle(conn)
        else:
            conn.close()


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
            transport = conn.transport
            assert transport is not None
            if len(body) < _READ_SIZE:
                transport.write(head + body)
            else:
                transport.writelines((head, body))
            await conn.drain()
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
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(target),
                    address,
                    port,
                    ssl=tls,
                    server_hostname=address if tls else None,
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
        return conn

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
