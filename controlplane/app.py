"""The control-plane ASGI app: REST API, health, metrics, and the controllers' loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from fastapi import Depends, FastAPI
from sqlalchemy.engine import Engine

from controlplane.api import (
    agents,
    deployments,
    events,
    gateway,
    health,
    hosts,
    logs,
    models,
    monitoring,
    rollouts,
    tokens,
)
from controlplane.api.body_limit import RequestBodyLimit
from controlplane.api.deps import AppContext, finite_numbers
from controlplane.api.errors import install_error_handlers
from controlplane.api.heartbeat_fastpath import HeartbeatFastPath
from controlplane.auth import AgentTokenCache
from controlplane.autoscaler.controller import AutoscaleController
from controlplane.controllers.host_health import HostHealthController, HostHealthMonitor
from controlplane.controllers.lease import DatabaseLease, new_holder_id
from controlplane.controllers.loop import CONTROLLERS_LEASE, ControllerLoop, LeaderCollector
from controlplane.db import make_engine
from controlplane.heartbeat.service import HeartbeatService
from controlplane.logs.retention import LogRetention
from controlplane.metrics import ControlPlaneMetrics, RequestMetricsMiddleware
from controlplane.model_files import ModelFiles
from controlplane.rollouts.controller import RolloutController
from controlplane.settings import ControlPlaneSettings
from protocol.wire import HEARTBEAT_PATH, Heartbeat

# Agents first: the heartbeat route is matched most often.
ROUTERS = (agents, gateway, hosts, models, deployments, rollouts, events, tokens, monitoring,
           logs, health)  # fmt: skip


def utc_now() -> datetime:
    """The real clock."""
    return datetime.now(UTC)


def create_app(
    settings: ControlPlaneSettings,
    *,
    clock: Callable[[], datetime] | None = None,
    engine: Engine | None = None,
    run_controllers: bool = True,
) -> FastAPI:
    """Build the app on `settings.resolved_database_url()` (or `engine`).

    The database must already be migrated (`controlplane.migrate.ensure_up_to_date`); the
    caller (`dctl server`) checks that and creates the first admin token. `clock` is injected
    so tests drive host health without sleeping; `run_controllers=False` leaves the controller
    rounds to the test (`app.state.controllers.step()`).
    """
    clock = clock or utc_now
    owns_engine = engine is None
    engine = engine or make_engine(settings.resolved_database_url())
    metrics = ControlPlaneMetrics(engine, clock)
    token_cache = AgentTokenCache()
    ctx = AppContext(
        settings=settings,
        engine=engine,
        clock=clock,
        heartbeats=HeartbeatService(
            engine,
            clock,
            token_cache,
            on_heartbeat=metrics.observe_heartbeat,
            interval_s=settings.heartbeat_interval_s,
            max_per_interval=settings.heartbeat_max_per_interval,
        ),
        health=HostHealthMonitor(engine, clock),
        metrics=metrics,
        token_cache=token_cache,
    )
    lease = DatabaseLease(
        engine, CONTROLLERS_LEASE, new_holder_id(), timedelta(seconds=settings.lease_s)
    )
    rollout_controller = RolloutController(
        engine, notify_allow_private=settings.notify_allow_private
    )
    controllers = ControllerLoop(
        lease,
        [
            HostHealthController(ctx.health),
            rollout_controller,
            AutoscaleController(engine),
            LogRetention(engine, settings),
        ],
        clock,
    )
    metrics.registry.register(LeaderCollector(controllers))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        task = None
        if run_controllers:
            task = asyncio.create_task(controllers.run(ctx.heartbeats.run_on_writer))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            ctx.heartbeats.close()
            rollout_controller.notifier.close()
            if owns_engine:
                engine.dispose()

    app = FastAPI(
        title="dctl control plane",
        version="1",
        description="Fleet of GPU hosts serving MoE block-diffusion LMs. Bearer tokens.",
        lifespan=lifespan,
        # Every body, whatever its route: JSON numbers must be finite.
        dependencies=[Depends(finite_numbers)],
    )
    app.state.ctx = ctx
    app.state.controllers = controllers
    app.state.model_files = ModelFiles(settings.model_roots)
    install_error_handlers(app)
    for module in ROUTERS:
        app.include_router(module.router)
    heartbeat_route = next(
        r for r in agents.router.routes if getattr(r, "path", None) == HEARTBEAT_PATH
    )
    # Inside the metrics middleware, so fast-lane heartbeats are counted like the rest.
    app.add_middleware(HeartbeatFastPath, ctx=ctx, route=heartbeat_route)
    # Outside the heartbeat lane: no body, not even a heartbeat's, is read past its limit.
    routes = [route for module in ROUTERS for route in module.router.routes]
    app.add_middleware(RequestBodyLimit, ctx=ctx, routes=routes)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    _document_wire_bodies(app)
    return app


def _document_wire_bodies(app: FastAPI) -> None:
    """Add the wire `Heartbeat` schema, which the heartbeat route parses itself, to OpenAPI."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            wire = Heartbeat.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, sub in wire.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components.setdefault("Heartbeat", wire)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]
