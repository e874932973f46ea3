"""`:deployments`: every deployment with its versions, readiness and gateway traffic."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding

from client import AsyncControlPlaneClient
from protocol.gateway import DeploymentTraffic
from protocol.rest import DeploymentOut
from tui import fetch, health
from tui import format as fmt
from tui.fetch import DeploymentsData
from tui.health import Thresholds
from tui.traffic import summarize
from tui.views.base import ViewScreen
from tui.widgets.cells import styled
from tui.widgets.table import ResourceTable, Row

COLUMNS = [
    "name",
    "model",
    "stable",
    "canary",
    "ready",
    "autoscale",
    "req/s",
    "err%",
    "p95",
    "ttft",
    "steps/blk",
    "tok/fwd",
]


def ready_cell(deployment: DeploymentOut) -> Any:
    """`ready/total` instances in the health colour."""
    total = len(deployment.instances)
    ready = sum(1 for i in deployment.instances if i.observed_state == "ready")
    return styled(f"{ready}/{total}", health.ready_ratio(ready, total))


def autoscale_counts(deployment: DeploymentOut) -> tuple[str, int] | None:
    """(`1/3/8`: min/current/max serving instances, standby instances); None when it is not
    autoscaled. Current is what the autoscaler wants now, or the serving instances before it
    reports."""
    policy, status = deployment.autoscale, deployment.autoscale_status
    if policy is None:
        return None
    serving = sum(1 for i in deployment.instances if not i.standby and not i.retiring)
    current = status.replicas if status is not None else serving
    standby = status.standby if status is not None else policy.standby
    return f"{policy.min}/{current}/{policy.max}", standby


def autoscale_cell(deployment: DeploymentOut) -> Any:
    """`1/3/8 +1` (standby) in the autoscaler's health colour; a dim `-` for a fixed count."""
    counts = autoscale_counts(deployment)
    if counts is None:
        return styled(fmt.NONE, "idle")
    replicas, standby = counts
    text = replicas + (f" +{standby}" if standby else "")
    return styled(text, health.autoscale(deployment))


def deployment_row(
    deployment: DeploymentOut, traffic: DeploymentTraffic | None, limits: Thresholds
) -> Row:
    """The deployments table's row for DEPLOYMENT."""
    figures = summarize(traffic)
    canary = (
        f"{deployment.canary_version} {deployment.canary_weight}%"
        if deployment.canary_version
        else fmt.NONE
    )
    return Row(
        deployment.name,
        (
            deployment.name,
            deployment.model,
            deployment.version,
            styled(canary, "warn" if deployment.canary_version else "idle"),
            ready_cell(deployment),
            autoscale_cell(deployment),
            fmt.number(figures.requests_per_s, 1),
            styled(
                fmt.ratio_percent(figures.error_rate), health.error_rate(figures.error_rate, limits)
            ),
            styled(fmt.millis(figures.p95_s), health.latency(figures.p95_s, limits)),
            fmt.millis(figures.ttft_p95_s),
            fmt.number(figures.steps_per_block, 1),
            fmt.number(figures.tokens_per_forward, 2),
        ),
    )


class DeploymentsScreen(ViewScreen):
    """The deployments table, focused with its first row selected; `enter` opens one."""

    TITLE = "deployments"
    HAS_FILTER = True
    BINDINGS: ClassVar[list[Any]] = [Binding("slash", "filter", "Filter", key_display="/")]

    def body(self) -> ComposeResult:
        """One table."""
        yield ResourceTable(COLUMNS, id="deployments")

    @property
    def table(self) -> ResourceTable:
        """The deployments table."""
        return self.query_one("#deployments", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> DeploymentsData:
        """Deployments and their traffic."""
        return await fetch.deployments(client)

    def show(self, data: DeploymentsData) -> None:
        """One row per deployment."""
        limits = self.dctl.thresholds
        self.table.show_rows(
            [deployment_row(d, data.traffic.get(d.name), limits) for d in data.deployments]
        )

    async def open_row(self, table: ResourceTable, key: str) -> None:
        """Open the deployment's detail."""
        await self.dctl.open_deployment(key)
