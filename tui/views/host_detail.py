"""Host detail: per-GPU bars and history (nvitop style), facts, preflight checks, instances;
`n` drains or undrains the host."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from client import AsyncControlPlaneClient
from protocol.rest import HostOut, SeriesOut
from protocol.wire import GpuStatus
from tui import fetch, health
from tui import format as fmt
from tui.fetch import HostDetailData
from tui.health import Thresholds
from tui.views.base import ViewScreen
from tui.widgets.cells import gauge, plain, spark, styled
from tui.widgets.table import ResourceTable, Row

GPU_COLUMNS = ["gpu", "name", "util", "memory", "history", "temp", "power", "ecc"]
CHECK_COLUMNS = ["check", "status", "reason"]
INSTANCE_COLUMNS = ["id", "deployment", "version", "port", "gpus", "state", "restarts", "message"]
HOST_KEYS = [("n", "drain_toggle", "Drain/undrain")]


def facts_text(host: HostOut, now: Any) -> Text:
    """The host's identity and facts; what the agent does not report reads N/A."""
    facts = host.facts
    state = styled(host.state, health.host_state(host.state, host.draining))
    text = Text.assemble(("host ", "bold"), (host.name, "bold"), "  ", state)
    if host.draining:
        text.append("  draining", style="yellow")
    text.append(f"  address {host.advertise_address or fmt.NA}")
    text.append(f"  heartbeat {fmt.age(host.last_seen_at, now)} ago")
    if facts is not None:
        text.append(
            f"\nagent {facts.agent_version or fmt.NA}  backend {facts.gpu_backend}"
            f"  driver {fmt.optional(facts.driver_version)}"
            f"  CUDA {fmt.optional(facts.cuda_driver_version)}"
            f"  CPUs {fmt.optional(facts.cpu_count)}  memory {fmt.size(facts.memory_bytes)}"
            f"  disk free {fmt.size(facts.disk_free_bytes)}"
        )
    if host.labels:
        text.append("\nlabels " + ", ".join(f"{k}={v}" for k, v in sorted(host.labels.items())))
    # What the agent reports counts for no placement until adopted: say so beside the real ones.
    pending = {k: v for k, v in host.reported_labels.items() if host.labels.get(k) != v}
    if pending:
        text.append("\nreported, not adopted ", style="dim")
        text.append(", ".join(f"{k}={v}" for k, v in sorted(pending.items())), style="dim")
        text.append(f"  (dctl host label {host.name} --adopt)", style="dim")
    return text


def gpu_row(gpu: GpuStatus, history: list[float], limits: Thresholds) -> Row:
    """One GPU: util and memory bars, a sparkline of recent util, temperature, power, ECC."""
    util = gpu.utilization_percent
    total, used = gpu.memory_total_bytes, gpu.memory_used_bytes
    power = fmt.optional(gpu.power_w, " W")
    if gpu.power_w is not None and gpu.power_limit_w is not None:
        power += f"/{gpu.power_limit_w:.0f}"
    return Row(
        str(gpu.index),
        (
            str(gpu.index),
            gpu.name.removeprefix("NVIDIA ") or fmt.NA,
            gauge(
                None if util is None else util / 100,
                "ok",
                width=8,
                label=fmt.percent(util),
            ),
            gauge(
                used / total if total else None,
                health.gpu_memory(used, total, limits),
                width=8,
                label=f"{fmt.size(used)}/{fmt.size(total)}" if total else "",
            ),
            spark(history, width=16, top=100.0),
            styled(
                fmt.optional(gpu.temperature_c, "°C"),
                health.gpu_temperature(gpu.temperature_c, limits),
            ),
            power,
            styled(fmt.optional(gpu.ecc_uncorrectable), health.ecc(gpu.ecc_uncorrectable)),
        ),
    )


def util_history(series: list[SeriesOut], index: int) -> list[float]:
    """GPU INDEX's utilisation samples, oldest first."""
    name = f"gpu{index}.utilization_percent"
    for item in series:
        if item.name == name and item.instance_id is None:
            return [value for _, value in item.points]
    return []


class HostDetailScreen(ViewScreen):
    """One host; `esc` goes back."""

    TITLE = "host"

    def __init__(self, name: str) -> None:
        super().__init__()
        self.host_name = name
        self.bind_actions(HOST_KEYS)

    def title_text(self) -> str:
        """`host gpu-1`."""
        return f"host {self.host_name}"

    def body(self) -> ComposeResult:
        """Facts, GPUs, preflight checks, instances."""
        with VerticalScroll(id="host-detail"):
            yield Static("loading…", id="facts")
            yield Static("GPUs", classes="section-title")
            yield ResourceTable(GPU_COLUMNS, id="gpus")
            yield Static("preflight", classes="section-title")
            yield ResourceTable(CHECK_COLUMNS, id="checks")
            yield Static("instances", classes="section-title")
            yield ResourceTable(INSTANCE_COLUMNS, id="instances")

    @property
    def table(self) -> ResourceTable:
        """The GPUs table (focused first)."""
        return self.query_one("#gpus", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> HostDetailData:
        """The host with instances and GPU samples."""
        return await fetch.host_detail(client, self.host_name)

    def show(self, data: HostDetailData) -> None:
        """Fill facts and tables."""
        host, limits = data.host, self.dctl.thresholds
        self.query_one("#facts", Static).update(plain(facts_text(host, self.dctl.now())))
        self.table.show_rows(
            [gpu_row(g, util_history(data.series, g.index), limits) for g in host.gpus]
        )
        checks = host.facts.preflight if host.facts else []
        self.query_one("#checks", ResourceTable).show_rows(
            [
                Row(c.name, (c.name, styled(c.status, health.check_status(c.status)), c.reason))
                for c in checks
            ]
        )
        self.query_one("#instances", ResourceTable).show_rows(
            [
                Row(
                    str(i.id),
                    (
                        str(i.id),
                        i.deployment,
                        i.version,
                        str(i.port),
                        ",".join(map(str, i.gpu_indices)) or "all",
                        styled(i.observed_state, health.instance_state(i.observed_state)),
                        str(i.restart_count),
                        i.message,
                    ),
                )
                for i in host.instances or []
            ]
        )

    def build_target(self) -> Any:
        """The host, for `n`."""
        if not isinstance(self.data, HostDetailData):
            return None
        from tui.actions import Target

        return Target(host=self.data.host)
