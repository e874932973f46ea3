"""The gateway's heartbeat: where it serves, its version and its /metrics, every few seconds.

The control plane lists a gateway as a scrape target while these come (and not once it is silent
for 3 intervals). Sent over the same control-plane link as routes and traffic reports, from a
task of its own: a traffic report stuck on a slow control plane must not make the gateway look
dead. A failed beat is logged once per outage; the next one retries.
"""

from __future__ import annotations

import asyncio
import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Protocol

from protocol.monitoring import GatewayHeartbeat, GatewayOut, Scheme, metrics_url

log = logging.getLogger("dctl.gateway.presence")


class PresenceSink(Protocol):
    """Where heartbeats go: `client.http.AsyncControlPlaneClient` implements it."""

    async def gateway_heartbeat(self, beat: GatewayHeartbeat) -> GatewayOut:
        """Post one heartbeat."""
        ...


def dctl_version() -> str:
    """The installed dctl version (what the gateway runs)."""
    try:
        return version("dctl")
    except PackageNotFoundError:
        return "0+unknown"


class GatewayPresence:
    """Heartbeats as gateway GATEWAY_ID serving SCHEME://ADDRESS:PORT every INTERVAL_S."""

    def __init__(
        self,
        sink: PresenceSink,
        *,
        gateway_id: str,
        address: str,
        port: int,
        scheme: Scheme,
        interval_s: float,
    ) -> None:
        self.sink = sink
        self.interval_s = interval_s
        # The gateway serves /metrics on its own port, beside the OpenAI routes.
        self.beat = GatewayHeartbeat(
            gateway=gateway_id,
            address=address,
            port=port,
            scheme=scheme,
            version=dctl_version(),
            metrics_url=metrics_url(scheme, address, port, None),
            interval_s=interval_s,
        )
        self.failing = False

    async def beat_once(self) -> bool:
        """Send one heartbeat; True when the control plane took it."""
        try:
            await self.sink.gateway_heartbeat(self.beat)
        except Exception as exc:  # ClientError or anything else: the gateway serves on
            if not self.failing:
                log.warning("cannot heartbeat to the control plane (retrying): %s", exc)
            self.failing = True
            return False
        if self.failing:
            log.info("gateway heartbeats accepted again")
            self.failing = False
        return True

    async def run(self) -> None:
        """Heartbeat at once, then every INTERVAL_S, until cancelled."""
        while True:
            await self.beat_once()
            await asyncio.sleep(self.interval_s)
