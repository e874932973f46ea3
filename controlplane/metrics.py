"""Control-plane Prometheus metrics: requests by route/status, heartbeat lag, hosts by state,
and each deployment's rollout (`controlplane.rollout_metrics`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.models import Host
from controlplane.rollout_metrics import RolloutCollector
from protocol.wire import HostState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class FleetCollector(Collector):
    """Gauges read from the store at scrape time (so every replica reports the same)."""

    def __init__(self, engine: Engine, clock: Callable[[], datetime]) -> None:
        self._engine = engine
        self._clock = clock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Hosts by state, the age of the oldest heartbeat among reachable hosts, and each
        host's heartbeat age with its state (so an alert can name the host that went quiet)."""
        hosts = GaugeMetricFamily("dctl_hosts", "Hosts by health state", labels=["state"])
        per_host = GaugeMetricFamily(
            "dctl_host_heartbeat_age_seconds",
            "Seconds since each host's last heartbeat, with its health state",
            labels=["host", "state"],
        )
        lag = GaugeMetricFamily(
            "dctl_heartbeat_lag_seconds",
            "Seconds since the least recent heartbeat of a host that is not unreachable",
        )
        with Session(self._engine) as session:
            counts = dict(
                session.exec(select(Host.state, func.count()).group_by(col(Host.state))).all()
            )
            oldest = session.exec(
                select(func.min(Host.last_seen_at)).where(Host.state != HostState.UNREACHABLE)
            ).first()
            seen = session.exec(select(Host.name, Host.state, Host.last_seen_at)).all()
        now = self._clock()
        for name, state, last_seen in seen:
            if last_seen is not None and last_seen.tzinfo is None:
                last_seen = last_seen.replace(tzinfo=now.tzinfo)
            age = (now - last_seen).total_seconds() if last_seen is not None else float("inf")
            per_host.add_metric([name, str(state)], max(0.0, age))
        for state in HostState:
            hosts.add_metric([state.value], float(counts.get(state.value, 0)))
        if oldest is not None:
            if oldest.tzinfo is None:
                oldest = oldest.replace(tzinfo=self._clock().tzinfo)
            lag.add_metric([], max(0.0, (self._clock() - oldest).total_seconds()))
        else:
            lag.add_metric([], 0.0)
        yield hosts
        yield lag
        yield per_host


class ControlPlaneMetrics:
    """One registry per app instance, so tests and replicas never share counters."""

    def __init__(self, engine: Engine, clock: Callable[[], datetime]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dctl_http_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dctl_http_request_duration_seconds",
            "HTTP request latency by route template",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.heartbeats = Counter("dctl_heartbeats", "Heartbeats accepted", registry=self.registry)
        self.heartbeat_interval = Histogram(
            "dctl_heartbeat_interval_seconds",
            "Seconds between consecutive heartbeats of a host",
            buckets=(1, 2.5, 5, 7.5, 10, 15, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.registry.register(FleetCollector(engine, clock))
        self.registry.register(RolloutCollector(engine))

    def observe_heartbeat(self, since_previous_s: float | None) -> None:
        """Count a heartbeat and how long after the previous one it came."""
        self.heartbeats.inc()
        if since_previous_s is not None:
            self.heartbeat_interval.observe(since_previous_s)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class RequestMetricsMiddleware:
    """Pure ASGI middleware (cheaper than BaseHTTPMiddleware on the heartbeat path)."""

    def __init__(self, app: ASGIApp, metrics: ControlPlaneMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Time the request and count it under its route template (bounded label values)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            # The method is the client's word (some servers pass any token): bound the labels.
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.requests.labels(method, template, str(status["code"])).inc()
            self.metrics.latency.labels(template).observe(time.perf_counter() - start)
