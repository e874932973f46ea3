"""The gateway's entry module: one gateway process, wired (`build_gateway`) and served (`run`).

`dctl gateway` only turns its flags into `GatewaySettings` and calls `run(settings)`.

`build_gateway` puts the parts together (routes, balancer, upstream pool, limits, metrics,
traffic windows, cold starts, the JSONL request log when one is set, and, with a control plane,
the route watcher, the traffic reporter with its request summaries and token counts, the
heartbeat that lists the gateway as a scrape target, and the wake calls for deployments scaled
to zero);
`run` serves it with uvicorn (uvloop, httptools with the connection deadlines of `deadlines.py`,
at most `max_connections` connections, no access log: the app logs one line per request itself)
until SIGTERM or SIGINT, then stops accepting, lets in-flight requests finish within
`shutdown_grace_s`, posts a last traffic report and writes the request log's last lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import math
import os
import random
import secrets
import socket
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import FrameType
from typing import Any, Protocol

from client.errors import ClientError
from client.http import AsyncControlPlaneClient
from gateway.access import RateLimiter, TokenSlots
from gateway.app import GatewayApp, Lifespan, Limits
from gateway.balancer import Balancer
from gateway.cold_start import ColdStarts, WakeSink
from gateway.metrics import GatewayMetrics
from gateway.pool_share import PoolShareCollector, PoolShares
from gateway.presence import GatewayPresence, PresenceSink
from gateway.proxy import Proxy
from gateway.request_log import RequestLog
from gateway.routes import Instance, Routes, RouteSource, RouteWatcher, RoutingTable
from gateway.settings import GatewaySettings, SettingsError
from gateway.summaries import RequestsSeen
from gateway.traffic import TrafficReporter, TrafficSink, TrafficWindows
from gateway.upstream import UpstreamPool
from runtime.logs import configure_logging
from runtime.tls import TlsError, client_context

log = logging.getLogger("dctl.gateway")

EXIT_OK, EXIT_FAILED = 0, 1
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}
_FINAL_REPORT_TIMEOUT_S = 5.0


class ControlPlaneLink(RouteSource, TrafficSink, PresenceSink, WakeSink, Protocol):
    """What the gateway needs of the control plane; `AsyncControlPlaneClient` is one, a test's
    stand-in another."""

    async def aclose(self) -> None:
        """Close the connections."""
        ...


@dataclass
class Gateway:
    """Every part of one gateway process, wired; `app` is what a server serves."""

    settings: GatewaySettings
    routes: Routes
    balancer: Balancer
    upstream: UpstreamPool
    metrics: GatewayMetrics
    windows: TrafficWindows
    app: GatewayApp
    control_plane: ControlPlaneLink | None = None
    watcher: RouteWatcher | None = None
    reporter: TrafficReporter | None = None
    presence: GatewayPresence | None = None
    request_log: RequestLog | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        """Start the request log's writer and, with a control plane, polling routes, reporting
        traffic and heartbeating."""
        if self.request_log is not None:
            self.request_log.start()
        if self.watcher is not None:
            self._tasks.append(asyncio.create_task(self.watcher.run(), name="routes"))
        if self.reporter is not None:
            self._tasks.append(asyncio.create_task(self.reporter.run(), name="traffic"))
        if self.presence is not None:
            self._tasks.append(asyncio.create_task(self.presence.run(), name="presence"))

    async def stop(self) -> None:
        """Stop the background tasks, post the last report, close connections."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.reporter is not None:
            try:
                await asyncio.wait_for(self.reporter.report_once(), _FINAL_REPORT_TIMEOUT_S)
            except TimeoutError:
                log.warning("the last traffic report timed out; its windows are lost")
        await self.app.cold_starts.close()
        if self.request_log is not None:
            await asyncio.to_thread(self.request_log.close)
        self.upstream.close()
        if self.control_plane is not None:
            await self.control_plane.aclose()


def gateway_id() -> str:
    """This process's id in traffic reports: hostname-pid-random."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"[:128]


def build_gateway(
    settings: GatewaySettings,
    *,
    port: int | None = None,
    control_plane: ControlPlaneLink | None = None,
    rng: random.Random | None = None,
) -> Gateway:
    """Wire a gateway for SETTINGS. PORT is the one it listens on (for its traffic reports);
    CONTROL_PLANE replaces the client built from the settings. Raises `SettingsError` when the
    token file, the routes file or a CA file cannot be used."""
    try:
        engine_tls = client_context(settings.engine_ca_file)
    except TlsError as exc:
        raise SettingsError(f"invalid setting engine_ca_file: {exc}") from None
    metrics = GatewayMetrics()
    upstream = UpstreamPool(
        connect_timeout_s=settings.upstream_connect_timeout_s,
        timeout_s=settings.upstream_timeout_s,
        tls=engine_tls,
    )

    def ejected(instance: Instance, seconds: float) -> None:
        metrics.ejections.labels(instance.deployment, instance.version, str(instance.id)).inc()
        log.warning(
            "instance ejected",
            extra={"instance": instance.id, "deployment": instance.deployment,
                   "version": instance.version, "seconds": seconds},
        )  # fmt: skip

    balancer = Balancer(time.monotonic, rng or random.Random(), on_eject=ejected)
    limiter = RateLimiter(settings.rate_limit_rps, settings.rate_limit_burst, time.monotonic)

    def installed(table: RoutingTable) -> None:
        # Per-instance and per-token state outlives tables, but not the things it is about.
        balancer.retain(table.instance_ids())
        limiter.retain(set(table.clients))
        upstream.retain({i.target for r in table.routes for p in (r.stable, r.canary) if p
                         for i in p.instances})  # fmt: skip

    routes = Routes(on_install=installed)
    shares = PoolShares(time.monotonic)
    metrics.registry.register(PoolShareCollector(shares, routes))
    windows = TrafficWindows(lambda: datetime.now(UTC), shares)
    proxy = Proxy(balancer, upstream, metrics, windows)
    limits = Limits(
        settings.max_body_bytes, settings.max_inflight, settings.pool_header,
        settings.body_timeout_s,
    )  # fmt: skip
    slots = TokenSlots(settings.max_concurrency_per_token)
    cold_starts = ColdStarts(routes, metrics)
    seen: RequestsSeen | None = None
    if settings.routes_file is None:  # a static routes file: nobody to report to
        seen = RequestsSeen(settings.summary_sample_rps, time.monotonic, rng)
    request_log = _request_log(settings, metrics)
    app = GatewayApp(
        routes=routes, proxy=proxy, limiter=limiter, slots=slots, metrics=metrics, limits=limits,
        cold_starts=cold_starts, seen=seen, request_log=request_log,
    )  # fmt: skip
    gateway = Gateway(settings, routes, balancer, upstream, metrics, windows, app)
    gateway.request_log = request_log
    app.lifespan = Lifespan(gateway.start, gateway.stop)

    if settings.routes_file is not None:
        routes.install(settings.read_routes_file())
        return gateway
    if control_plane is None:
        assert settings.control_plane is not None  # settings.check(): one or the other
        try:
            control_plane = AsyncControlPlaneClient(
                settings.control_plane, settings.read_token(), ca_file=settings.ca_file
            )
        except ClientError as exc:
            raise SettingsError(f"invalid setting control_plane: {exc}") from None
    gateway.control_plane = control_plane
    cold_starts.sink = control_plane
    gateway.watcher = RouteWatcher(control_plane, routes, settings.routes_poll_s)
    this_gateway = gateway_id()
    address = socket.gethostname() if settings.host in _WILDCARDS else settings.host
    gateway.reporter = TrafficReporter(
        windows,
        control_plane,
        gateway_id=this_gateway,
        address=address,
        port=port or settings.port or None,
        interval_s=settings.report_interval_s,
        seen=seen,
    )
    if port or settings.port:
        # Only a known port can be scraped (build_gateway without one is a test's).
        try:
            gateway.presence = GatewayPresence(
                control_plane,
                gateway_id=this_gateway,
                address=address.strip("[]"),
                port=port or settings.port,
                scheme="https" if settings.tls_cert else "http",
                interval_s=settings.report_interval_s,
            )
        except ValueError as exc:  # an address the control plane would refuse: serve anyway
            log.warning("no heartbeats (not listed as a scrape target): %s", exc)
    return gateway


def _request_log(settings: GatewaySettings, metrics: GatewayMetrics) -> RequestLog | None:
    """The JSONL request log of SETTINGS (None: off); `SettingsError` when it cannot be written."""
    path = settings.request_log_file
    if path is None:
        return None
    lines = metrics.request_log_lines
    try:
        return RequestLog(
            path,
            max_bytes=settings.request_log_max_bytes,
            max_files=settings.request_log_max_files,
            written=lines.labels("written"),
            dropped=lines.labels("dropped"),
        )
    except OSError as exc:
        raise SettingsError(
            f"invalid setting request_log_file: cannot write {path}: {exc.strerror or exc}"
        ) from None


class _CommittedStreamEnd(logging.Filter):
    """Drops uvicorn's complaint about a response the app ended short on purpose (the engine
    failed mid-stream; the proxy logged why already)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("ASGI callable returned without completing")


def run(settings: GatewaySettings) -> int:
    """Serve SETTINGS until SIGTERM/SIGINT (blocking); returns the process exit code: 0 after a
    graceful stop, 1 when it could not listen or start. Raises `SettingsError` for a setting
    found unusable at start (token file, routes file, CA files). Configures logging itself."""
    import prometheus_client
    import uvicorn

    configure_logging(settings.log_level, settings.log_format)
    logging.getLogger("uvicorn.error").addFilter(_CommittedStreamEnd())
    prometheus_client.disable_created_metrics()  # `_created` samples only double the scrape
    try:
        listener = _listen(settings.host, settings.port)
    except OSError as exc:
        log.error(
            "cannot listen on %s:%s: %s; choose another --port or stop what uses it",
            settings.host, settings.port, exc.strerror or exc,
        )  # fmt: skip
        return EXIT_FAILED
    port = int(listener.getsockname()[1])
    try:
        gateway = build_gateway(settings, port=port)
    except BaseException:
        listener.close()
        raise
    scheme = "https" if settings.tls_cert else "http"

    class GatewayServer(uvicorn.Server):
        """uvicorn, saying where it listens once it does, and exiting 0 after a drain."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # uvicorn re-raises the signal after its graceful shutdown, which turns a clean
            # SIGTERM into exit status 143; a drained gateway has done its job and exits 0.
            # A second signal stops at once.
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        async def startup(self, sockets: list[Any] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                log.info(
                    "listening",
                    extra={"address": f"{scheme}://{settings.host}:{port}",
                           "routes": str(settings.routes_file or settings.control_plane)},
                )  # fmt: skip

    server = GatewayServer(uvicorn.Config(gateway.app, **server_options(settings)))
    server.run(sockets=[listener])
    listener.close()
    return EXIT_OK if server.started else EXIT_FAILED


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn's `Config` options for SETTINGS, the app aside: what `run` serves with."""
    from gateway.deadlines import Deadlines, protocol_for

    deadlines = Deadlines(settings.idle_timeout_s, settings.head_timeout_s, settings.body_timeout_s)
    return {
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": protocol_for(deadlines),
        "lifespan": "on",
        "log_config": None,  # dctl's structured logging (and its redaction)
        "access_log": False,
        "proxy_headers": False,  # nothing reads the client's address; saves a layer per request
        "server_header": False,
        # Connections (and requests) past which uvicorn answers 503 without calling the app:
        # what each open connection costs is bounded, however many a client opens.
        "limit_concurrency": settings.max_connections,
        "timeout_graceful_shutdown": math.ceil(settings.shutdown_grace_s),
        "ssl_certfile": str(settings.tls_cert) if settings.tls_cert else None,
        "ssl_keyfile": str(settings.tls_key) if settings.tls_key else None,
    }


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT (0: any free port) for uvicorn to serve on."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
    except OSError:
        listener.close()
        raise
    return listener
