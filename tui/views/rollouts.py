"""`:rollouts`: every deployment's rollouts, rollbacks and restarts, newest first, with how
each ended and why."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding

from client import AsyncControlPlaneClient
from protocol.rollouts import RolloutOut
from tui import fetch, health
from tui import format as fmt
from tui.views.base import ViewScreen
from tui.widgets.cells import styled
from tui.widgets.table import ResourceTable, Row

COLUMNS = ["deployment", "id", "kind", "outcome", "from -> to", "steps", "started", "reason"]


def rollout_row(rollout: RolloutOut) -> Row:
    """One rollout of the history."""
    return Row(
        f"{rollout.deployment}/{rollout.id}",
        (
            rollout.deployment,
            str(rollout.id),
            rollout.kind,
            styled(rollout.state, health.rollout_state(rollout.state)),
            f"{rollout.from_} -> {rollout.to}",
            "/".join(map(str, rollout.steps)) or fmt.NONE,
            fmt.aware(rollout.created_at).strftime("%m-%d %H:%M"),
            rollout.reason or fmt.NONE,
        ),
    )


class RolloutsScreen(ViewScreen):
    """The rollout history across deployments; `enter` opens the deployment."""

    TITLE = "rollouts"
    HAS_FILTER = True
    BINDINGS: ClassVar[list[Any]] = [Binding("slash", "filter", "Filter", key_display="/")]

    def body(self) -> ComposeResult:
        """One table."""
        yield ResourceTable(COLUMNS, id="rollouts")

    @property
    def table(self) -> ResourceTable:
        """The history table."""
        return self.query_one("#rollouts", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> list[RolloutOut]:
        """Every deployment's history."""
        return await fetch.rollouts(client)

    def show(self, data: list[RolloutOut]) -> None:
        """One row per rollout."""
        self.table.show_rows([rollout_row(r) for r in data])

    async def open_row(self, table: ResourceTable, key: str) -> None:
        """Open the rollout's deployment."""
        await self.dctl.open_deployment(key.partition("/")[0])
