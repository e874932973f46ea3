"""Deployment detail: instances, the rollout panel (from -> to, step bar, time left, analysis),
and per-version sparklines; the rollout keys (c p P a u b r R) act on it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from client import AsyncControlPlaneClient
from protocol.rest import DeploymentOut
from protocol.rollout_states import ACTIVE_STATES
from protocol.rollouts import RolloutOut
from protocol.version_ref import VersionRef
from tui import fetch, health
from tui import format as fmt
from tui.fetch import DeploymentDetailData
from tui.traffic import p95_series, request_rates
from tui.views.base import ViewScreen
from tui.views.deployments import ready_cell
from tui.widgets.cells import plain, progress, spark, styled
from tui.widgets.table import ResourceTable, Row

INSTANCE_COLUMNS = ["id", "host", "port", "version", "state", "restarts", "message"]
ANALYSIS_COLUMNS = ["metric", "stable", "canary", "limit", "verdict", "note"]
# The keys of `tui.actions.ACTION_KEYS` this view binds, with the footer's words for them.
DEPLOYMENT_KEYS = [
    ("c", "canary", "Canary"),
    ("p", "promote", "Promote"),
    ("P", "promote_full", "Promote all"),
    ("a", "abort", "Abort"),
    ("u", "pause_resume", "Pause/resume"),
    ("b", "rollback", "Rollback"),
    ("r", "restart", "Restart"),
    ("R", "restart_instance", "Restart inst"),
]
HISTORY = 60  # tokens/forward points kept per version (one per refresh)


def header_text(deployment: DeploymentOut) -> Text:
    """Name, versions, placement and readiness."""
    text = Text.assemble(("stable ", "bold"), str(VersionRef(deployment.model, deployment.version)))
    if deployment.canary_version:
        text.append(
            f"  canary {deployment.canary_version} {deployment.canary_weight}%", style="yellow"
        )
    text.append("  ready ")
    text.append_text(ready_cell(deployment))
    hosts = ", ".join(deployment.placement.hosts) or fmt.NONE
    labels = ", ".join(f"{k}={v}" for k, v in deployment.placement.labels.items())
    text.append(f"\nplacement hosts {hosts}" + (f" labels {labels}" if labels else ""))
    text.append(f"  instances/host {deployment.instances_per_host}")
    return text


def rollout_text(rollout: RolloutOut | None) -> Text:
    """The rollout panel: kind, from -> to, state, phase, step bar, time left, reason."""
    if rollout is None:
        return Text("no rollout yet", style="dim")
    text = Text.assemble(
        (f"{rollout.kind} #{rollout.id} ", "bold"),
        f"{rollout.from_} -> {rollout.to}  ",
        (rollout.state, health.STYLE[health.rollout_state(rollout.state)]),
        f"  {rollout.phase}",
    )
    text.append("\n")
    text.append_text(
        progress(rollout.step, len(rollout.steps), rollout.weight, served=rollout.served)
    )
    left = fmt.duration(rollout.time_left_s) if rollout.time_left_s is not None else fmt.NONE
    text.append(f"  time left {left}")
    text.append(f"\ncanary {rollout.canary_ready}/{rollout.canary_instances} ready")
    text.append(f"  stable {rollout.stable_ready} ready  by {rollout.actor}")
    if rollout.reason:
        text.append(f"\n{rollout.reason}", style="italic")
    return text


class DeploymentDetailScreen(ViewScreen):
    """One deployment; `esc` goes back."""

    TITLE = "deployment"

    def __init__(self, name: str) -> None:
        super().__init__()
        self.deployment_name = name
        self._tokens_per_forward: dict[int, list[float]] = defaultdict(list)
        self.bind_actions(DEPLOYMENT_KEYS)

    def title_text(self) -> str:
        """`deployment web`."""
        return f"deployment {self.deployment_name}"

    def body(self) -> ComposeResult:
        """Header, instances, rollout, analysis, traffic."""
        with VerticalScroll(id="deployment-detail"):
            yield Static("loading…", id="header")
            yield Static("instances", classes="section-title")
            yield ResourceTable(INSTANCE_COLUMNS, id="instances")
            yield Static("rollout", classes="section-title")
            yield Static("", id="rollout")
            yield Static("analysis", classes="section-title", id="analysis-title")
            yield ResourceTable(ANALYSIS_COLUMNS, id="analysis")
            yield Static("traffic per version (last 5 min)", classes="section-title")
            yield Static("", id="traffic")

    @property
    def table(self) -> ResourceTable:
        """The instances table (`R` restarts its selected row)."""
        return self.query_one("#instances", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> DeploymentDetailData:
        """The deployment, its rollout, traffic and model."""
        return await fetch.deployment_detail(client, self.deployment_name)

    def show(self, data: DeploymentDetailData) -> None:
        """Fill every panel."""
        deployment = data.deployment
        self.query_one("#header", Static).update(plain(header_text(deployment)))
        self.table.show_rows(
            [
                Row(
                    str(i.id),
                    (
                        str(i.id),
                        i.host,
                        str(i.port),
                        i.version,
                        styled(i.observed_state, health.instance_state(i.observed_state)),
                        str(i.restart_count),
                        i.message,
                    ),
                )
                for i in deployment.instances
            ]
        )
        self.query_one("#rollout", Static).update(plain(rollout_text(data.rollout)))
        analysis = data.rollout.analysis if data.rollout else None
        self.query_one("#analysis-title", Static).update(
            plain(
                f"analysis: step {analysis.step} at {analysis.weight}%, {analysis.verdict}, "
                f"{analysis.canary_requests} canary / {analysis.stable_requests} stable requests"
                if analysis
                else "analysis: none yet"
            )
        )
        self.query_one("#analysis", ResourceTable).show_rows(
            [
                Row(
                    m.metric,
                    (
                        m.metric,
                        fmt.metric(m.unit, m.stable),
                        fmt.metric(m.unit, m.canary),
                        m.limit,
                        styled(m.verdict, health.verdict(m.verdict)),
                        m.note,
                    ),
                )
                for m in (analysis.metrics if analysis else [])
            ]
        )
        self.query_one("#traffic", Static).update(plain(self._traffic_text(data)))

    def _traffic_text(self, data: DeploymentDetailData) -> Text:
        traffic = data.traffic
        if traffic is None or not traffic.versions:
            return Text("no traffic reported", style="dim")
        rates, p95 = request_rates(traffic), p95_series(traffic)
        lines = []
        for version in traffic.versions:
            history = self._tokens_per_forward[version.version_id]
            if version.tokens_per_forward is not None:
                history.append(version.tokens_per_forward)
                del history[:-HISTORY]
            line = Text(f"{version.version:<16} ", style="bold")
            line.append("req/s ")
            line.append_text(spark(rates.get(version.version_id, []), width=12))
            line.append("  p95 ")
            line.append_text(spark(p95.get(version.version_id, []), width=12, style="magenta"))
            line.append("  tok/fwd ")
            line.append_text(spark(history, width=12, style="green"))
            lines.append(line)
        return Text("\n").join(lines)

    def build_target(self) -> Any:
        """The deployment, its active rollout, the selected instance and the model's versions."""
        if not isinstance(self.data, DeploymentDetailData):
            return None
        from tui.actions import Target

        rollout = self.data.rollout
        model = self.data.model
        selected = self.table.selected_key
        versions = (
            tuple(
                str(VersionRef(model.name, v.version)) for v in model.versions if not v.deprecated
            )
            if model is not None
            else ()
        )
        return Target(
            deployment=self.data.deployment,
            rollout=rollout if rollout and rollout.state in ACTIVE_STATES else None,
            instance_id=int(selected) if selected else None,
            versions=versions,
        )
