"""The gateway's ASGI app: OpenAI-compatible `/v1/*` in front of the fleet, plus health and
`/metrics`.

    POST /v1/chat/completions, POST /v1/completions   client token; forwarded (`proxy`)
    GET  /v1/models                                   client token; what it may use
    GET  /metrics                                     Prometheus text, no auth
    GET  /health                                      200 with a routing table and a ready
                                                      instance of some deployment (or one
                                                      scaled to zero: it wakes), else 503
    GET  /health/live                                 200 while the process serves
    GET  /health/ready                                200 once a routing table is loaded

A completion request is checked in order of cost: in-flight limit (503), token (401), the
token's requests in flight (429), rate (429), `x-dctl-pool` (403 without the token's grant,
400 for a bad value), body size (413) and time (408: `body_timeout_s` after the headers), JSON
with a `model` (400), the model known (404, listing the models the token may use), the token's
scope (403); then held while the deployment is scaled to zero with no instance (`cold_start`:
served once one is ready, else 503 after its `cold_start_timeout_s`); then forwarded. The body
is parsed only to find `model`: the engine validates the rest. A held request keeps its slots,
so the in-flight limits bound the waiting too. Every refusal is in OpenAI's error shape and
carries the request id (`x-request-id`: the client's when it is a sane token, else a new one),
which also goes to the engine and into the one log line per request.

Each completion request ends in one `RequestSummary`: into the JSONL request log when there is
one (every request, refusals included), and into the next traffic report (`RequestsSeen`) when
it was routed to a deployment; a refusal of the client's token (`ClientTokenRefused`) is counted for
the report by token and reason instead.

A pinned request is counted apart (`pinned="true"` in the metrics, in no traffic window): the
rollout analysis reads the windows, and the sender of a pinned request chose its version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gateway.access import RateLimiter, TokenSlots, authenticate, check_pool_pin, check_scope
from gateway.asgi import Receive, Scope, Send, header_map, send_bytes, send_error, send_json
from gateway.cold_start import ColdStarts
from gateway.errors import ClientTokenRefused, GatewayError, not_found
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.proxy import Forwarded, ForwardRequest, Proxy
from gateway.request_log import RequestLog
from gateway.routes import ClientGrant, Routes, RoutingTable
from gateway.summaries import RequestsSeen
from protocol.gateway import Pool
from protocol.logs import REQUEST_ID_PATTERN, RequestSummary
from runtime.asgi_body import CLIENT_CLOSED_REQUEST, BodyTooLarge, ClientGone, read_body

log = logging.getLogger("dctl.gateway.requests")

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN.encode())
# Header values copied into the engine request: printable ASCII only (no CR/LF), bounded.
_HEADER_VALUE_RE = re.compile(rb"[\t\x20-\x7e]{1,1024}")
_POOLS: dict[bytes, Pool] = {b"stable": "stable", b"canary": "canary"}


@dataclass(frozen=True)
class Limits:
    """What one gateway process accepts."""

    max_body_bytes: int
    max_inflight: int
    pool_header: bool
    body_timeout_s: float  # from the request's headers to the end of its body


@dataclass
class Arrival:
    """A completion request as far as the gateway got with it, for its summary."""

    request_id: bytes
    received_at: float  # on the proxy's clock
    time: float  # the wall clock, epoch seconds
    grant: ClientGrant | None = None
    deployment: str = ""  # the one its `model` names
    routed: bool = False  # the token may use it: on to the deployment
    pinned: Pool | None = None
    stream: bool = False


@dataclass(frozen=True)
class Lifespan:
    """What runs when the server starts and stops (background tasks, the last report)."""

    startup: Callable[[], Awaitable[None]]
    shutdown: Callable[[], Awaitable[None]]


class GatewayApp:
    """The ASGI callable. NOW is the wall clock in epoch seconds (token expiry), CLOCK the
    proxy's monotonic clock (durations). SEEN keeps what the traffic reports say of requests
    and tokens (None: no reports), REQUEST_LOG is the JSONL request log (None: off)."""

    def __init__(
        self,
        *,
        routes: Routes,
        proxy: Proxy,
        limiter: RateLimiter,
        slots: TokenSlots,
        metrics: GatewayMetrics,
        limits: Limits,
        cold_starts: ColdStarts,
        lifespan: Lifespan | None = None,
        seen: RequestsSeen | None = None,
        request_log: RequestLog | None = None,
        now: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.routes = routes
        self.proxy = proxy
        self.limiter = limiter
        self.slots = slots
        self.metrics = metrics
        self.limits = limits
        self.cold_starts = cold_starts
        self.lifespan = lifespan
        self.seen = seen
        self.request_log = request_log
        self.inflight = 0
        self._now = now
        self._clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    if self.lifespan is not None:
                        await self.lifespan.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.lifespan is not None:
                    await self.lifespan.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if path in COMPLETION_PATHS:
            if method == "POST":
                await self._completion(scope, receive, send)
            else:
                await send_error(send, _wrong_method(method, path, "POST"))
        elif path == "/v1/models":
            if method == "GET":
                await self._models(scope, send)
            else:
                await send_error(send, _wrong_method(method, path, "GET"))
        elif path == "/metrics":
            await send_bytes(send, 200, self.metrics.render(), CONTENT_TYPE.encode())
        elif path == "/health":
            await self._health(send)
        elif path == "/health/live":
            await send_json(send, 200, {"status": "live"})
        elif path == "/health/ready":
            table = self.routes.current
            if table is None:
                await send_json(send, 503, {"status": "waiting for a routing table"})
            else:
                await send_json(send, 200, {"status": "ready", "routes": table.etag})
        else:
            await send_error(send, not_found(path))

    async def _health(self, send: Send) -> None:
        """vLLM's and SGLang's `/health`, which benchmark clients check first: 200 when a
        request could be served now (a routing table with a ready instance, or a deployment
        scaled to zero, which a request wakes), else 503 and why."""
        table = self.routes.current
        if table is None:
            await send_json(send, 503, {"status": "unavailable", "reason": "no routing table yet"})
        elif not table.instance_ids() and not any(r.cold_start_timeout_s for r in table.routes):
            reason = "no deployment has a ready instance"
            await send_json(send, 503, {"status": "unavailable", "reason": reason})
        else:
            await send_json(send, 200, {"status": "ok", "routes": table.etag})

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        received_at = self._clock()
        headers = header_map(scope)
        arrival = Arrival(_request_id(headers.get(b"x-request-id")), received_at, self._now())
        if self.inflight >= self.limits.max_inflight:
            error = GatewayError(
                503,
                f"this gateway is serving its limit of {self.limits.max_inflight} requests "
                "(max_inflight); retry shortly",
                code="overloaded",
            )
            await self._refuse(send, error, arrival, scope)
            return
        self.inflight += 1
        self.metrics.inflight.inc()
        slot: str | None = None  # the key id whose slot this request holds
        try:
            try:
                table = self._table()
                authorization = headers.get(b"authorization")
                grant = arrival.grant = authenticate(authorization, table, arrival.time)
                self.slots.take(grant)
                slot = grant.key_id
                self.limiter.admit(grant)
                pinned = arrival.pinned = self._pinned(headers.get(b"x-dctl-pool"), grant)
                body = await self._body(receive, headers.get(b"content-length"))
                model, arrival.stream = _model_of(body)
                route = table.by_model.get(model)
                if route is None:
                    raise _unknown_model(model, table, grant)
                arrival.deployment = route.deployment
                check_scope(grant, route.deployment)
                arrival.routed = True
                if self.cold_starts.holds(route):
                    route = await self.cold_starts.wait(route, receive)
            except GatewayError as error:
                await self._refuse(send, error, arrival, scope)
                return
            except ClientGone:
                self.metrics.count(None, CLIENT_CLOSED_REQUEST)
                self._finished(
                    scope, arrival, Forwarded(CLIENT_CLOSED_REQUEST, error="client left")
                )
                return
            request = ForwardRequest(
                path=scope["path"].encode(),
                body=body,
                request_id=arrival.request_id,
                content_type=_clean(headers.get(b"content-type")),
                accept=_clean(headers.get(b"accept")),
                pinned=pinned,
                received_at=received_at,
            )
            result = await self.proxy.forward(route, request, receive, send)
            self._finished(scope, arrival, result)
        finally:
            if slot is not None:
                self.slots.give_back(slot)
            self.inflight -= 1
            self.metrics.inflight.dec()

    async def _body(self, receive: Receive, declared: bytes | None) -> bytes:
        """The whole body, or a 408 when it has not arrived within `body_timeout_s`: a client
        that declares a body and never sends it would otherwise hold its slots forever."""
        timeout_s = self.limits.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await read_body(receive, declared, self.limits.max_body_bytes)
        except BodyTooLarge as exc:
            raise GatewayError(
                413,
                f"request body is larger than this gateway's limit of {exc.limit} bytes "
                "(max_body_bytes)",
                code="request_too_large",
            ) from None
        except TimeoutError:
            raise GatewayError(
                408,
                f"the request body did not arrive within {timeout_s:g} s of its headers "
                "(body_timeout_s); send the whole body right after the headers",
                code="request_timeout",
                headers={"connection": "close"},  # what is left of the body must not be parsed
            ) from None

    async def _models(self, scope: Scope, send: Send) -> None:
        headers = header_map(scope)
        try:
            table = self._table()
            grant = authenticate(headers.get(b"authorization"), table, self._now())
            self.limiter.admit(grant)
        except GatewayError as error:
            if isinstance(error, ClientTokenRefused) and self.seen is not None:
                self.seen.refused(error.refusal)
            await send_error(send, error)
            return
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "dctl"}
            for name in table.models_for(grant)
        ]
        await send_json(send, 200, {"object": "list", "data": data})

    def _table(self) -> RoutingTable:
        table = self.routes.current
        if table is None:
            raise GatewayError(
                503,
                "the gateway has no routing table yet (control plane not reached so far)",
                code="not_ready",
            )
        return table

    def _pinned(self, value: bytes | None, grant: ClientGrant) -> Pool | None:
        if value is None or not self.limits.pool_header:
            return None
        check_pool_pin(grant)
        pool = _POOLS.get(value.strip().lower())
        if pool is None:
            raise GatewayError(
                400,
                "x-dctl-pool must be `stable` or `canary`",
                param="x-dctl-pool",
                code="invalid_pool",
            )
        return pool

    async def _refuse(
        self, send: Send, error: GatewayError, arrival: Arrival, scope: Scope
    ) -> None:
        await send_error(send, error, arrival.request_id)
        self.metrics.count(None, error.status)
        if isinstance(error, ClientTokenRefused) and self.seen is not None:
            self.seen.refused(error.refusal)
        self._finished(scope, arrival, Forwarded(error.status, error=error.message))

    def _finished(self, scope: Scope, arrival: Arrival, result: Forwarded) -> None:
        """The request's log line, its summary for the request log and, routed, for the next
        traffic report."""
        latency_s = self._clock() - arrival.received_at
        if log.isEnabledFor(logging.INFO):
            _log(scope, arrival, result, latency_s)
        if self.request_log is None and (self.seen is None or not arrival.routed):
            return
        summary = _summary(arrival, result, latency_s)
        if self.request_log is not None:
            self.request_log.write(summary)
        if self.seen is not None and arrival.routed:
            self.seen.served(summary)


def _log(scope: Scope, arrival: Arrival, result: Forwarded, latency_s: float) -> None:
    """The request's line in the gateway's own log."""
    extra: dict[str, Any] = {
        "request_id": arrival.request_id.decode(),
        "path": scope["path"],
        "status": result.status,
        "duration_ms": round(latency_s * 1000, 2),
    }
    if arrival.grant is not None:
        extra["client"] = arrival.grant.name
    if result.pool is not None:
        extra["deployment"] = result.pool.deployment
        extra["version"] = result.pool.version
        extra["pool"] = result.pool.name
    if arrival.pinned is not None:
        extra["pinned"] = True
    if result.instance is not None:
        extra["instance"] = result.instance.id
    if result.retries:
        extra["retries"] = result.retries
    if result.error:
        extra["error"] = result.error
    log.info("request", extra=extra)


def _summary(arrival: Arrival, result: Forwarded, latency_s: float) -> RequestSummary:
    """The request's `RequestSummary` (built unchecked: every value is the gateway's own)."""
    pool, usage = result.pool, result.usage
    ttft_s = result.ttft_s
    return RequestSummary.model_construct(
        request_id=arrival.request_id.decode(),
        time=datetime.fromtimestamp(arrival.time, UTC),
        token=arrival.grant.name if arrival.grant else "",
        deployment=pool.deployment if pool else arrival.deployment,
        version=pool.version if pool else "",
        pool=pool.name if pool else "",
        instance_id=result.instance.id if result.instance else None,
        status=result.status,
        prompt_tokens=usage.prompt_tokens if usage else None,
        completion_tokens=usage.completion_tokens if usage else None,
        steps_per_block=usage.steps_per_block if usage else None,
        tokens_per_forward=usage.tokens_per_forward if usage else None,
        ttft_s=round(ttft_s, 6) if ttft_s is not None else None,
        latency_s=round(max(latency_s, 0.0), 6),
        stream=arrival.stream,
    )


def _request_id(value: bytes | None) -> bytes:
    """The client's request id when it is a sane token of at most 128 characters, else new."""
    if value is not None and _REQUEST_ID_RE.fullmatch(value):
        return value
    return uuid.uuid4().hex.encode()


def _clean(value: bytes | None) -> bytes | None:
    """A header value safe to copy into the engine request (no control characters), or None."""
    return value if value is not None and _HEADER_VALUE_RE.fullmatch(value) else None


def _model_of(body: bytes) -> tuple[str, bool]:
    """The request's `model` and whether it asks for a stream, or a 400 saying what is wrong
    with the body."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise GatewayError(400, f"request body is not JSON: {exc}", code="invalid_json") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, str) or not model:
        raise GatewayError(
            400, "request body has no `model`: name a model (GET /v1/models lists them)",
            param="model", code="missing_model",
        )  # fmt: skip
    return model, data.get("stream") is True


def _unknown_model(model: str, table: RoutingTable, grant: ClientGrant) -> GatewayError:
    models = table.models_for(grant)
    return GatewayError(
        404,
        f"model {model[:256]!r} does not exist here; "
        + (f"models you may use: {', '.join(models)}" if models else "you may use no model yet"),
        param="model",
        code="model_not_found",
    )


def _wrong_method(method: str, path: str, allowed: str) -> GatewayError:
    return GatewayError(
        405, f"{method} {path}: use {allowed}", code="method_not_allowed",
        headers={"allow": allowed},
    )  # fmt: skip
