"""`:overview`, the start screen: fleet counts, alerts, deployments, hosts, active rollouts and
the newest events, each compact enough to fit 80x24."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.widgets import Static

from client import AsyncControlPlaneClient
from protocol.rest import FleetStatus
from protocol.rollouts import RolloutOut
from protocol.version_ref import VersionRef
from tui import fetch, health
from tui import format as fmt
from tui.fetch import OverviewData
from tui.views.base import ViewScreen
from tui.widgets.cells import plain, progress, styled
from tui.widgets.table import ResourceTable, Row

EVENTS_SHOWN = 8


def fleet_text(status: FleetStatus) -> Text:
    """`hosts 2 ready · 1 not ready · 0 unreachable | GPUs 4 | instances 2/2 ready`."""
    by_state = status.hosts_by_state
    text = Text("hosts ")
    for index, state in enumerate(("ready", "not_ready", "unreachable")):
        if index:
            text.append(" · ")
        count = by_state.get(state, 0)
        style = health.STYLE[health.host_state(state)] if count else ""
        text.append(f"{count} {state.replace('_', ' ')}", style=style)
    if status.hosts_draining:
        text.append(f" · {status.hosts_draining} draining", style="yellow")
    ready = status.instances_by_state.get("ready", 0)
    total = sum(status.instances_by_state.values())
    text.append(f"\nGPUs {status.gpus}   instances ")
    text.append(f"{ready}/{total} ready", style=health.STYLE[health.ready_ratio(ready, total)])
    text.append(f"   models {status.models}   deployments {status.deployments}")
    return text


def rollout_line(rollout: RolloutOut) -> Text:
    """One active rollout: deployment, from -> to, state, step bar, time left."""
    text = Text(f"{rollout.deployment} ", style="bold")
    text.append(f"{rollout.from_} -> {rollout.to} ")
    text.append(rollout.state, style=health.STYLE[health.rollout_state(rollout.state)])
    text.append("\n  ")
    text.append_text(progress(rollout.step, len(rollout.steps), rollout.weight, width=16))
    if rollout.time_left_s is not None:
        text.append(f"  {fmt.duration(rollout.time_left_s)} left")
    return text


class OverviewScreen(ViewScreen):
    """The fleet at a glance; `enter` on a deployment or host opens its detail."""

    TITLE = "overview"
    BINDINGS: ClassVar[list[Any]] = [
        Binding("d", "focus_panel('deployments')", "Deployments"),
        Binding("h", "focus_panel('hosts')", "Hosts"),
    ]

    def body(self) -> ComposeResult:
        """Counts and alerts on top, then tables, rollouts and events."""
        with Grid(id="overview"):
            with Vertical(classes="panel", id="fleet-panel"):
                yield Static("fleet", classes="section-title")
                yield Static("loading…", id="fleet")
                yield Static("", id="alerts")
            with Vertical(classes="panel"):
                yield Static("deployments", classes="section-title")
                yield ResourceTable(["name", "versions", "ready"], id="deployments")
            with Vertical(classes="panel"):
                yield Static("hosts", classes="section-title")
                yield ResourceTable(["name", "state", "gpus"], id="hosts")
            with Vertical(classes="panel", id="rollouts-panel"):
                yield Static("active rollouts", classes="section-title")
                yield Static("", id="rollouts")
            with Vertical(classes="panel", id="events-panel"):
                yield Static("last events", classes="section-title")
                yield ResourceTable(["time", "kind", "subject", "message"], id="events")

    @property
    def table(self) -> ResourceTable | None:
        """The focused table, else the deployments table."""
        focused = self.focused
        if isinstance(focused, ResourceTable) and focused.id in ("deployments", "hosts"):
            return focused
        return self.query_one("#deployments", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> OverviewData:
        """Counts, hosts, deployments, active rollouts, the newest events."""
        return await fetch.overview(client, EVENTS_SHOWN)

    def show(self, data: OverviewData) -> None:
        """Fill every panel."""
        self.query_one("#fleet", Static).update(plain(fleet_text(data.status)))
        self.query_one("#alerts", Static).update(plain(self._alerts(data)))
        self.query_one("#deployments", ResourceTable).show_rows(
            [
                Row(
                    d.name,
                    (
                        d.name,
                        str(VersionRef(d.model, d.version))
                        + (f" +{d.canary_version} {d.canary_weight}%" if d.canary_version else ""),
                        self._ready(d.instances),
                    ),
                )
                for d in data.deployments
            ]
        )
        self.query_one("#hosts", ResourceTable).show_rows(
            [
                Row(
                    h.name,
                    (
                        h.name,
                        styled(
                            h.state + (" (draining)" if h.draining else ""),
                            health.host_state(h.state, h.draining),
                        ),
                        str(len(h.gpus)),
                    ),
                )
                for h in data.hosts
            ]
        )
        rollouts = Text("\n").join(rollout_line(r) for r in data.rollouts)
        self.query_one("#rollouts", Static).update(plain(rollouts or Text("none", style="dim")))
        self.query_one("#events", ResourceTable).show_rows(
            [
                Row(str(e.id), (fmt.clock_time(e.time), e.kind, e.subject, e.message))
                for e in data.events
            ]
        )

    @staticmethod
    def _ready(instances: list[Any]) -> Text:
        ready = sum(1 for i in instances if i.observed_state == "ready")
        return styled(f"{ready}/{len(instances)}", health.ready_ratio(ready, len(instances)))

    @staticmethod
    def _alerts(data: OverviewData) -> Text:
        found = health.alerts(data.hosts, data.deployments)
        if not found:
            return Text("no alerts", style="green")
        return Text("\n").join(
            Text(f"! {a.subject}: {a.text}", style=health.STYLE[a.level]) for a in found
        )

    async def open_row(self, table: ResourceTable, key: str) -> None:
        """A deployment row opens its detail, a host row the host's."""
        if table.id == "hosts":
            await self.dctl.open_host(key)
        elif table.id == "deployments":
            await self.dctl.open_deployment(key)

    def action_focus_panel(self, which: str) -> None:
        """Move to the deployments or hosts table."""
        self.query_one(f"#{which}", ResourceTable).focus()
