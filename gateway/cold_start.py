"""Requests for a deployment scaled to zero: held while the control plane starts an instance.

A route with `cold_start_timeout_s` belongs to a deployment whose autoscale policy allows zero
instances. A request for it that finds neither pool with an instance is held rather than refused,
and its wait ends one of four ways (the `outcome` of `dctl_gateway_cold_start_wait_seconds`):

    held --a routing table lists an instance--> served (forwarded as usual)
    held --cold_start_timeout_s passes-->       timeout (503 with Retry-After)
    held --the deployment leaves the table-->   gone (404)
    held --the client disconnects-->            client_left

The routing table alone says when an instance is ready: a held request waits for the next table
installed (`Routes.next_table`), never polls. While any request for a deployment is held, one
task per deployment asks the control plane to wake it, at once and again every
`WAKE_INTERVAL_S`: one call in flight however many requests wait. A failed call is logged and
retried; it never fails a request by itself. Held requests keep their gateway in-flight slot and
their token's slot, so the limits that bound requests bound the waiting too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Literal, Protocol

from client.errors import ClientError
from gateway.asgi import Receive
from gateway.errors import GatewayError
from gateway.metrics import GatewayMetrics
from gateway.routes import Route, Routes, RoutingTable
from runtime.asgi_body import ClientGone, until_disconnected

log = logging.getLogger("dctl.gateway.cold_start")

WAKE_INTERVAL_S = 2.0
# What a client told to come back is asked to wait: an instance that missed the timeout is
# usually still loading its weights, and a retry is held again anyway.
RETRY_AFTER_S = 5

Outcome = Literal["served", "timeout", "gone", "client_left"]
WakeResult = Literal["accepted", "gone", "failed"]


class WakeSink(Protocol):
    """Who starts instances: the control plane's `POST /api/v1/deployments/{name}/wake`."""

    async def wake_deployment(self, name: str) -> None:
        """Ask for an instance of deployment NAME (a no-op for one that has instances)."""
        ...


class ColdStarts:
    """Holds requests for deployments scaled to zero and wakes those deployments.

    SINK None (a static routes file): requests are held for a table that a reload could bring,
    and nothing is woken. CLOCK is monotonic seconds, for the wait histogram.
    """

    def __init__(
        self,
        routes: Routes,
        metrics: GatewayMetrics,
        sink: WakeSink | None = None,
        *,
        wake_interval_s: float = WAKE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.routes = routes
        self.metrics = metrics
        self.sink = sink
        self.wake_interval_s = wake_interval_s
        self._clock = clock
        self._held: dict[str, int] = {}  # deployment -> requests held (absent: none)
        self._wakers: dict[str, asyncio.Task[None]] = {}

    @staticmethod
    def holds(route: Route) -> bool:
        """Whether a request for ROUTE waits for a cold start instead of a 503 at once."""
        return route.cold_start_timeout_s is not None and not route.has_instances

    def held(self, deployment: str) -> int:
        """Requests held for DEPLOYMENT right now."""
        return self._held.get(deployment, 0)

    async def wait(self, route: Route, receive: Receive) -> Route:
        """Hold a request for ROUTE's deployment until a table lists an instance of it; that
        table's route. Raises `GatewayError` (timeout: 503; gone: 404) and `ClientGone`."""
        deployment = route.deployment
        timeout_s = route.cold_start_timeout_s
        assert timeout_s is not None, "holds(route) first"
        started = self._clock()
        outcome: Outcome | None = None  # None: cancelled from outside (the server stopping)
        self._hold(deployment)
        left = asyncio.ensure_future(until_disconnected(receive))
        changed: asyncio.Future[RoutingTable] | None = None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    table = self.routes.current
                    current = table.route(deployment) if table is not None else None
                    if current is None:
                        outcome = "gone"
                        raise _gone(deployment)
                    if current.has_instances:
                        outcome = "served"
                        return current
                    changed = self.routes.next_table()
                    await asyncio.wait((changed, left), return_when=asyncio.FIRST_COMPLETED)
                    if left.done():
                        outcome = "client_left"
                        raise ClientGone
        except TimeoutError:
            outcome = "timeout"
            raise _starting(deployment, timeout_s) from None
        finally:
            left.cancel()
            if changed is not None:
                changed.cancel()
            self._release(deployment)
            if outcome is not None:
                waited = self._clock() - started
                self.metrics.cold_start_wait.labels(deployment, outcome).observe(waited)

    async def close(self) -> None:
        """Stop waking (the gateway is stopping)."""
        wakers = list(self._wakers.values())
        for task in wakers:
            task.cancel()
        for task in wakers:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _hold(self, deployment: str) -> None:
        self._held[deployment] = self._held.get(deployment, 0) + 1
        self.metrics.cold_start_waiting.labels(deployment).inc()
        if self.sink is not None and deployment not in self._wakers:
            self._wakers[deployment] = asyncio.create_task(
                self._wake(self.sink, deployment), name=f"wake {deployment}"
            )

    def _release(self, deployment: str) -> None:
        held = self._held.pop(deployment) - 1
        if held:
            self._held[deployment] = held
        self.metrics.cold_start_waiting.labels(deployment).dec()

    async def _wake(self, sink: WakeSink, deployment: str) -> None:
        """Wake DEPLOYMENT every `wake_interval_s` while requests are held for it. The task
        outlives its last request by at most one interval, so calls stay that far apart."""
        failures = 0
        try:
            while self._held.get(deployment):
                result = await self._wake_once(sink, deployment, failures)
                failures = 0 if result == "accepted" else failures + 1
                await asyncio.sleep(self.wake_interval_s)
        finally:
            del self._wakers[deployment]

    async def _wake_once(self, sink: WakeSink, deployment: str, failures: int) -> WakeResult:
        result: WakeResult
        try:
            await sink.wake_deployment(deployment)
        except Exception as exc:  # ClientError or anything else: the requests wait on
            gone = isinstance(exc, ClientError) and exc.status == 404
            result = "gone" if gone else "failed"
            if failures == 0:  # once per streak: the next calls would repeat it every interval
                log.warning("cannot wake deployment %s (retrying every %g s while requests "
                            "wait): %s", deployment, self.wake_interval_s, exc)  # fmt: skip
        else:
            result = "accepted"
            if failures:
                log.info("deployment %s woken after %d failed calls", deployment, failures)
        self.metrics.wake_calls.labels(deployment, result).inc()
        return result


def _starting(deployment: str, timeout_s: float) -> GatewayError:
    return GatewayError(
        503,
        f"deployment {deployment} is starting from zero (scaled to zero): no instance became "
        f"ready within {timeout_s:g} s (its cold_start_timeout_s); retry in a few seconds",
        code="cold_start_timeout",
        headers={"retry-after": str(RETRY_AFTER_S)},
    )


def _gone(deployment: str) -> GatewayError:
    return GatewayError(
        404,
        f"deployment {deployment} was removed while this request waited for it to start; "
        "GET /v1/models lists the models you may use",
        param="model",
        code="model_not_found",
    )
