"""Forwarding one completion request to an engine and its answer back, byte for byte.

    pick (balancer) -> send -> first body bytes -> commit: head + bytes to the client -> stream

Nothing reaches the client before the engine's first body bytes, so until then a failed attempt
can be repeated: once, on another instance of the same pool (else of the other pool), when the
connection could not be made, closed (or was reset) unanswered, the engine answered 503
(draining), or it answered a 5xx that is no API answer (not JSON: its HTTP server failed around
the API, e.g. a handler cancelled by a shutdown; the API's own 5xx, such as a canary's failures,
are the client's to see). After the commit nothing is retried; a failure mid-stream ends the
client's response abruptly (it sees a truncated body, never a fake end). The client's
`Authorization` never goes upstream: each instance gets its own API key.

A client that disconnects cancels the forwarding, which closes the engine connection, which is
how the engine learns to stop generating.

Each attempt is counted in its version's traffic window (a failed first attempt too, so a canary
that refuses connections shows errors even when retries hide them from clients); Prometheus
counts the answers clients got. A pinned request (`x-dctl-pool`) is in no traffic window: its
sender chose the version, so its outcome says nothing the rollout analysis may judge by; the
metrics count it with `pinned="true"`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.asgi import Headers, Receive, Send, send_error
from gateway.balancer import Balancer
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.routes import Instance, Route, VersionPool
from gateway.traffic import ErrorClass, TrafficWindows
from gateway.upstream import (
    ConnectFailed,
    Exchange,
    ExchangeTimeout,
    UpstreamError,
    UpstreamPool,
)
from gateway.usage import UsageReader
from protocol.gateway import Pool
from runtime.asgi_body import CLIENT_CLOSED_REQUEST, until_disconnected

# Response headers that describe the engine's connection, not the answer, or that the gateway
# sets itself.
_DROPPED_HEADERS = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
        b"transfer-encoding", b"upgrade", b"date", b"server", b"x-request-id",
        b"x-dctl-version", b"x-dctl-instance",
    }
)  # fmt: skip


@dataclass
class ForwardRequest:
    """A checked completion request, ready to forward."""

    path: bytes
    body: bytes
    request_id: bytes
    content_type: bytes | None
    accept: bytes | None
    pinned: Pool | None
    received_at: float  # on the proxy's clock


@dataclass
class Forwarded:
    """How a forwarded request ended, for the request's log line and summary."""

    status: int
    pool: VersionPool | None = None
    instance: Instance | None = None
    retries: int = 0
    error: str | None = None
    ttft_s: float | None = None  # to the first token (a stream), else to the first body byte
    usage: UsageReader | None = None  # what the engine's usage report said (a 2xx answer)


class _Retry(Exception):
    """An attempt failed in a way that may be retried elsewhere."""

    def __init__(
        self,
        reason: str,
        error: ErrorClass,
        answer: tuple[Exchange, bytes | None] | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason  # the retries metric's label
        self.error = error  # how the traffic window counts the attempt
        self.answer = answer  # a 503 answer, handed on when there is nowhere else to go


@dataclass
class _Progress:
    """Where a forwarding is, shared with the disconnect watcher."""

    done: bool = False  # the response is complete (a disconnect now changes nothing)
    client_gone: bool = False
    pool: VersionPool | None = None
    instance: Instance | None = None
    retries: int = 0
    ttft_s: float | None = None
    usage: UsageReader | None = None


class Proxy:
    """Forwards requests; CLOCK is `time.perf_counter`-like (seconds, monotonic)."""

    def __init__(
        self,
        balancer: Balancer,
        upstream: UpstreamPool,
        metrics: GatewayMetrics,
        windows: TrafficWindows,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.balancer = balancer
        self.upstream = upstream
        self.metrics = metrics
        self.windows = windows
        self._clock = clock

    async def forward(
        self, route: Route, request: ForwardRequest, receive: Receive, send: Send
    ) -> Forwarded:
        """Forward REQUEST along ROUTE and stream the answer to SEND. Whatever the engine or the
        client does, the answer (or its absence) says it; only outside cancellation raises."""
        task = asyncio.current_task()
        assert task is not None
        progress = _Progress()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, progress, task))
        try:
            return await self._forward(route, request, send, progress)
        except asyncio.CancelledError:
            if not progress.client_gone:
                raise
            task.uncancel()
            gone = CLIENT_CLOSED_REQUEST
            if progress.pool is not None:
                self._finish(progress.pool, gone, None, request, progress.ttft_s, 0)
            return Forwarded(
                gone, progress.pool, progress.instance, progress.retries, "client left",
                progress.ttft_s, progress.usage,
            )  # fmt: skip
        finally:
            progress.done = True
            watcher.cancel()

    async def _forward(
        self, route: Route, request: ForwardRequest, send: Send, progress: _Progress
    ) -> Forwarded:
        order = self.balancer.pool_order(route, request.pinned)
        picked = self.balancer.pick(order)
        if picked is None:
            return await self._unavailable(route, order, request, send)
        pool, instance = picked
        retries = 0
        while True:
            progress.pool, progress.instance, progress.retries = pool, instance, retries
            started = self._clock()
            try:
                exchange, first = await self._attempt(instance, request)
            except ExchangeTimeout as exc:
                return await self._timed_out(pool, instance, request, send, exc, retries)
            except _Retry as failed:
                self._failed(instance)
                again = None
                if retries == 0:
                    again = self.balancer.pick(_retry_order(order, pool), exclude=(instance.id,))
                if again is not None:
                    if failed.answer is not None:
                        failed.answer[0].release()
                    self._record(pool, request, failed.error, self._clock() - started)
                    self.metrics.retries.labels(route.deployment, failed.reason).inc()
                    pool, instance = again
                    retries += 1
                    continue
                if failed.answer is None:
                    return await self._give_up(
                        route, pool, instance, request, send, failed, retries
                    )
                exchange, first = failed.answer  # the engine's 503, as it said it
            else:
                if exchange.status >= 500:
                    self._failed(instance)
                else:
                    self.balancer.succeeded(instance)
            return await self._stream(pool, instance, exchange, first, request, send, progress)

    async def _attempt(
        self, instance: Instance, request: ForwardRequest
    ) -> tuple[Exchange, bytes | None]:
        """Send to INSTANCE and wait for the first body bytes; `_Retry` for what may be retried."""
        self.balancer.started(instance)
        try:
            try:
                exchange = await self.upstream.send(
                    instance.target, _request_head(instance, request), request.body
                )
            except ConnectFailed as exc:
                raise _Retry("connect", "connect") from exc
            except ExchangeTimeout:
                raise
            except UpstreamError as exc:
                raise _Retry("broken", "5xx") from exc
            try:
                first = await exchange.next_chunk()
            except BaseException as exc:
                exchange.release()
                if isinstance(exc, UpstreamError) and not isinstance(exc, ExchangeTimeout):
                    raise _Retry("broken", "5xx") from exc
                raise
            if exchange.status == 503:
                raise _Retry("unavailable", "5xx", (exchange, first))
            if exchange.status >= 500 and not _is_json(exchange.headers):
                raise _Retry("broken", "5xx", (exchange, first))  # the instance failed, not the API
            return exchange, first
        finally:
            self.balancer.finished(instance)

    async def _stream(
        self,
        pool: VersionPool,
        instance: Instance,
        exchange: Exchange,
        first: bytes | None,
        request: ForwardRequest,
        send: Send,
        progress: _Progress,
    ) -> Forwarded:
        """Commit: the engine's head and body to the client as they come."""
        status = exchange.status
        reader: UsageReader | None = None
        if status < 300:
            reader = progress.usage = UsageReader(event_stream=_is_event_stream(exchange.headers))
        headers: Headers = [(k, v) for k, v in exchange.headers if k not in _DROPPED_HEADERS]
        headers += [
            (b"x-dctl-version", pool.version_header),
            (b"x-dctl-instance", str(instance.id).encode()),
            (b"x-request-id", request.request_id),
        ]
        self.balancer.started(instance)
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if first is not None:
                if reader is not None:
                    first = reader.feed(first)
                self._first_token(progress, request, reader)
            if exchange.complete:
                progress.done = True
                await send({"type": "http.response.body", "body": _ended(first or b"", reader)})
            else:
                if first:
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                while (chunk := await exchange.next_chunk()) is not None:
                    if reader is not None:
                        chunk = reader.feed(chunk)
                        if progress.ttft_s is None:
                            self._first_token(progress, request, reader)
                    if exchange.complete:  # the last bytes: one write with the body's end
                        break
                    if chunk:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                progress.done = True
                await send({"type": "http.response.body", "body": _ended(chunk or b"", reader)})
        except UpstreamError as exc:
            # Committed: the client's response ends short (uvicorn closes the connection).
            cut: tuple[int, ErrorClass] = (504, "timeout")
            if not isinstance(exc, ExchangeTimeout):
                cut = (502, "5xx")
                self._failed(instance)
            self._finish(pool, cut[0], cut[1], request, progress.ttft_s, 0)
            return Forwarded(
                cut[0], pool, instance, progress.retries, f"mid-stream: {exc}",
                progress.ttft_s, reader,
            )  # fmt: skip
        finally:
            self.balancer.finished(instance)
            exchange.release()
        error: ErrorClass | None = None
        if status >= 500:
            error = "5xx"
        elif status >= 400:
            error = "client_4xx"
        tokens = reader.tokens if reader is not None else 0
        self._finish(pool, status, error, request, progress.ttft_s, tokens)
        return Forwarded(status, pool, instance, progress.retries, None, progress.ttft_s, reader)

    def _first_token(
        self, progress: _Progress, request: ForwardRequest, reader: UsageReader | None
    ) -> None:
        """Note the time to first token: at the first event with text in a stream (a chat
        stream opens with a role-only chunk), else at the first body bytes."""
        if progress.ttft_s is None and (
            reader is None or not reader.event_stream or reader.first_token
        ):
            progress.ttft_s = self._clock() - request.received_at

    async def _unavailable(
        self, route: Route, order: tuple[VersionPool, ...], request: ForwardRequest, send: Send
    ) -> Forwarded:
        """No pool has a usable instance: 503."""
        if not order:  # pinned to a pool the deployment does not have
            error = GatewayError(
                503,
                f"deployment {route.deployment} has no {request.pinned} pool right now "
                "(x-dctl-pool)",
                code="pool_unavailable",
            )
            await send_error(send, error, request.request_id)
            self.metrics.count(None, 503)
            return Forwarded(503, error=error.message)
        pool = order[0]
        error = GatewayError(
            503,
            f"deployment {route.deployment} has no instance able to serve right now "
            "(none ready, or all failing); retry shortly",
            code="no_instance",
        )
        await send_error(send, error, request.request_id)
        self._finish(pool, 503, "connect", request, None, 0)
        return Forwarded(503, pool, error=error.message)

    async def _give_up(
        self,
        route: Route,
        pool: VersionPool,
        instance: Instance,
        request: ForwardRequest,
        send: Send,
        failed: _Retry,
        retries: int,
    ) -> Forwarded:
        """The last attempt failed before an answer: 503 (unreachable) or 502 (unanswered)."""
        if failed.reason == "connect":
            status, what = 503, "could not be reached"
        else:
            status, what = 502, "closed the connection without answering"
        error = GatewayError(
            status,
            f"deployment {route.deployment}: instance {instance.id} {what}"
            + (" (and so did the one tried before)" if retries else "")
            + "; retry shortly",
            code="upstream_unavailable",
        )
        await send_error(send, error, request.request_id)
        self._finish(pool, status, failed.error, request, None, 0)
        return Forwarded(status, pool, instance, retries, str(failed.__cause__ or failed))

    async def _timed_out(
        self,
        pool: VersionPool,
        instance: Instance,
        request: ForwardRequest,
        send: Send,
        exc: ExchangeTimeout,
        retries: int,
    ) -> Forwarded:
        """The engine did not answer in time: 504."""
        error = GatewayError(
            504,
            f"the engine did not answer within {self.upstream.timeout_s:g} s (upstream_timeout_s)",
            code="timeout",
        )
        await send_error(send, error, request.request_id)
        self._finish(pool, 504, "timeout", request, None, 0)
        return Forwarded(504, pool, instance, retries, str(exc))

    def _failed(self, instance: Instance) -> None:
        self.balancer.failed(instance)  # an ejection is counted by the balancer's on_eject

    def _record(
        self, pool: VersionPool, request: ForwardRequest, error: ErrorClass, latency_s: float
    ) -> None:
        """Count a failed attempt that was retried (traffic window only)."""
        if request.pinned is None:
            key = (pool.deployment, pool.version_id, pool.name)
            self.windows.record(key, error, latency_s, None, 0)

    def _finish(
        self,
        pool: VersionPool,
        status: int,
        error: ErrorClass | None,
        request: ForwardRequest,
        ttft_s: float | None,
        tokens: int,
    ) -> None:
        """Count the answer the client got (metrics) and the attempt (traffic window)."""
        latency = self._clock() - request.received_at
        series = self.metrics.series(
            pool.deployment, pool.version, pool.name, request.pinned is not None
        )
        self.metrics.count(series, status)
        series.duration.observe(latency)
        if ttft_s is not None:
            series.ttft.observe(ttft_s)
        if tokens:
            series.output_tokens.inc(tokens)
        if request.pinned is None:  # the sender chose the version: not the analysis's to judge
            key = (pool.deployment, pool.version_id, pool.name)
            self.windows.record(key, error, latency, ttft_s, tokens)


async def _watch_disconnect(receive: Receive, progress: _Progress, task: asyncio.Task[Any]) -> None:
    """Cancel TASK when the client disconnects before its response is complete."""
    await until_disconnected(receive)
    if not progress.done:
        progress.client_gone = True
        task.cancel()


def _is_event_stream(headers: Headers) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _is_json(headers: Headers) -> bool:
    return any(k == b"content-type" and v.startswith(b"application/json") for k, v in headers)


def _ended(last: bytes, reader: UsageReader | None) -> bytes:
    """The body's last bytes, with what READER held back (no usage comment after all)."""
    return last + reader.end() if reader is not None else last


def _retry_order(order: tuple[VersionPool, ...], pool: VersionPool) -> tuple[VersionPool, ...]:
    """The same pool first, then the others."""
    return (pool, *(p for p in order if p is not pool))


def _request_head(instance: Instance, request: ForwardRequest) -> bytes:
    parts = [
        b"POST ", request.path, b" HTTP/1.1\r\nhost: ", instance.host_header,
        b"\r\nauthorization: ", instance.authorization,
        b"\r\ncontent-length: ", str(len(request.body)).encode(),
        b"\r\nx-request-id: ", request.request_id,
    ]  # fmt: skip
    if request.content_type is not None:
        parts += (b"\r\ncontent-type: ", request.content_type)
    if request.accept is not None:
        parts += (b"\r\naccept: ", request.accept)
    parts.append(b"\r\n\r\n")
    return b"".join(parts)
