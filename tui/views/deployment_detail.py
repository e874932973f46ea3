"""Deployment detail: instances, the rollout panel (from -> to, step bar, time left, analysis),
and per-version sparklines; the rollout keys (c p P a u b r R) act on it."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from client import AsyncControlPlaneClient
from protocol.rest import DeploymentOut, InstanceOut
from protocol.rollout_states import ACTIVE_STATES
from protocol.rollouts import RolloutOut
from protocol.version_ref import VersionRef
from tui import fetch, health
from tui import format as fmt
from tui.fetch import DeploymentDetailData
from tui.traffic import p95_series, request_rates
from tui.views.base import ViewScreen
from tui.views.deployments import autoscale_counts, ready_cell
from tui.widgets.cells import plain, progress, spark, styled
from tui.widgets.table import ResourceTable, Row

INSTANCE_COLUMNS = [
    "id", "host", "port", "version", "role", "state", "run/wait", "restarts", "message",
]  # fmt: skip
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


def header_text(deployment: DeploymentOut, now: datetime) -> Text:
    """Name, versions, placement and readiness, then autoscaling when it is on."""
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
    if deployment.autoscale is None:
        text.append(f"  instances/host {deployment.instances_per_host}")
        return text
    text.append("\n")
    text.append_text(autoscale_text(deployment, now))
    return text


def autoscale_text(deployment: DeploymentOut, now: datetime) -> Text:
    """`autoscale 1/3/8 +1` (min/current/max, standby) with readiness and load, the last
    decision, and whether it is pinned at max or starved of GPUs."""
    counts = autoscale_counts(deployment)
    assert counts is not None, "only an autoscaled deployment has this panel"
    replicas, standby = counts
    text = Text("autoscale ", style="bold")
    text.append_text(styled(replicas, health.autoscale(deployment)))
    text.append(" min/now/max" + (f" +{standby} standby" if standby else ""))
    status = deployment.autoscale_status
    if status is None:
        text.append("  no autoscaler report yet", style="dim")
        return text
    text.append(f"  serving {status.serving_ready}/{status.replicas} ready")
    if status.standby:
        text.append(f"  standby {status.standby_ready}/{status.standby} ready")
    busy = status.utilization
    text.append(f"  queue/inst {fmt.number(status.queue_per_instance, 1)}")
    text.append(f"  busy {fmt.NONE if busy is None else fmt.percent(busy * 100)}")
    decision = status.last_decision
    if decision is not None:
        text.append(
            f"\nlast {decision.action} {decision.from_replicas}->{decision.to_replicas} "
            f"{fmt.age(decision.time, now)} ago"
            + (f": {decision.reason}" if decision.reason else "")
        )
    if status.pinned_at_max_since is not None:
        pinned = fmt.age(status.pinned_at_max_since, now)
        text.append(
            f"\npinned at max for {pinned}: raise max or add GPUs", style=health.STYLE["warn"]
        )
    if status.starved_since is not None:
        # Red when it serves fewer than its minimum, else yellow (`health.autoscale`).
        why = status.starved_reason or "fewer instances placed than wanted"
        starved = fmt.age(status.starved_since, now)
        text.append(
            f"\nstarved for {starved}: {why}", style=health.STYLE[health.autoscale(deployment)]
        )
    return text


# How an instance's part in serving reads: standby and retiring ones are out of the pools.
ROLE_STYLE = {"serving": "", "standby": "cyan", "retiring": "yellow"}


def instance_role(instance: InstanceOut) -> Text:
    """`serving`, `standby` (loaded, out of the pools) or `retiring` (finishing its requests)."""
    role = "retiring" if instance.retiring else "standby" if instance.standby else "serving"
    return Text(role, style=ROLE_STYLE[role])


def instance_load(instance: InstanceOut) -> str:
    """`running/waiting` requests as its engine last said; `-` when it never did."""
    running, waiting = instance.requests_running, instance.requests_waiting
    if running is None and waiting is None:
        return fmt.NONE
    return f"{fmt.NONE if running is None else running}/{fmt.NONE if waiting is None else waiting}"


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
        header = header_text(deployment, self.dctl.now())
        self.query_one("#header", Static).update(plain(header))
        self.table.show_rows(
            [
                Row(
                    str(i.id),
                    (
                        str(i.id),
                        i.host,
                        str(i.port),
                        i.version,
                        instance_role(i),
                        styled(i.observed_state, health.instance_state(i.observed_state)),
                        instance_load(i),
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
