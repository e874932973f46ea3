"""`:hosts`: every host with its state, GPUs, memory, instances and heartbeat age."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding

from client import AsyncControlPlaneClient
from protocol.rest import HostOut
from tui import fetch, health
from tui import format as fmt
from tui.fetch import FleetData
from tui.health import Thresholds
from tui.views.base import ViewScreen
from tui.widgets.cells import styled
from tui.widgets.table import ResourceTable, Row

COLUMNS = ["name", "state", "address", "gpus", "util", "memory", "inst", "agent", "heartbeat"]


def mean_util(host: HostOut) -> float | None:
    """Mean utilisation of the host's GPUs that report one; None when none does."""
    known = [g.utilization_percent for g in host.gpus if g.utilization_percent is not None]
    return sum(known) / len(known) if known else None


def host_row(host: HostOut, instances: int, now: datetime, limits: Thresholds) -> Row:
    """The hosts table's row for HOST."""
    used = sum(g.memory_used_bytes for g in host.gpus)
    total = sum(g.memory_total_bytes for g in host.gpus)
    beat_age = fmt.seconds_since(host.last_seen_at, now)
    state = host.state + (" (draining)" if host.draining else "")
    return Row(
        host.name,
        (
            host.name,
            styled(state, health.host_state(host.state, host.draining)),
            host.advertise_address or fmt.NONE,
            str(len(host.gpus)),
            fmt.percent(mean_util(host)),
            styled(
                f"{fmt.size(used)} / {fmt.size(total)}" if total else fmt.NA,
                health.gpu_memory(used, total, limits),
            ),
            str(instances),
            (host.facts.agent_version if host.facts else "") or fmt.NONE,
            styled(
                fmt.duration(beat_age),
                health.heartbeat(beat_age, host.heartbeat_interval_s, limits),
            ),
        ),
    )


class HostsScreen(ViewScreen):
    """The hosts table; `enter` opens a host, `/` filters."""

    TITLE = "hosts"
    HAS_FILTER = True
    BINDINGS: ClassVar[list[Any]] = [Binding("slash", "filter", "Filter", key_display="/")]

    def body(self) -> ComposeResult:
        """One table."""
        yield ResourceTable(COLUMNS, id="hosts")

    @property
    def table(self) -> ResourceTable:
        """The hosts table."""
        return self.query_one("#hosts", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> FleetData:
        """Hosts, and deployments to count instances per host."""
        return await fetch.fleet(client)

    def show(self, data: FleetData) -> None:
        """One row per host."""
        per_host = Counter(i.host for d in data.deployments for i in d.instances)
        now, limits = self.dctl.now(), self.dctl.thresholds
        self.table.show_rows([host_row(h, per_host[h.name], now, limits) for h in data.hosts])

    async def open_row(self, table: ResourceTable, key: str) -> None:
        """Open the host's detail."""
        await self.dctl.open_host(key)
