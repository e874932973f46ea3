"""The agent's own `/metrics`, for a user's Prometheus: GPU gauges (`dctl_gpu_`, base units) plus
snapshot, supervisor, heartbeat and log shipping counters (`dctl_agent_`), on a registry of its
own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.gpu import GpuDevice, GpuSnapshot

_GPU_LABELS = ["gpu", "uuid", "name"]
# (metric name, help, how to read it off a device); a None reading (N/A) exports no sample.
_GPU_GAUGES: list[tuple[str, str, Any]] = [
    ("dctl_gpu_memory_total_bytes", "GPU memory in total.", lambda d: d.memory_total_bytes),
    ("dctl_gpu_memory_used_bytes", "GPU memory in use.", lambda d: d.memory_used_bytes),
    ("dctl_gpu_utilization_ratio", "GPU busy time, 0..1.", lambda d: d.utilization_ratio),
    ("dctl_gpu_temperature_celsius", "GPU core temperature.", lambda d: d.temperature_celsius),
    ("dctl_gpu_power_watts", "GPU power draw.", lambda d: d.power_watts),
    ("dctl_gpu_power_limit_watts", "Enforced power limit.", lambda d: d.power_limit_watts),
    (
        "dctl_gpu_ecc_uncorrected_errors",
        "Uncorrectable ECC errors since the last reset (volatile).",
        lambda d: d.ecc_uncorrected_errors,
    ),
    ("dctl_gpu_up", "1 when the GPU answers, 0 when it is lost.", lambda d: d.health == "ok"),
]


class GpuCollector(Collector):
    """Exports the most recent GPU sample at scrape time."""

    def __init__(self) -> None:
        self.sample: GpuSnapshot | None = None

    def collect(self) -> Iterable[Metric]:
        """One gauge family per GPU figure, one sample per device."""
        devices: tuple[GpuDevice, ...] = self.sample.devices if self.sample else ()
        for name, doc, read in _GPU_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=_GPU_LABELS)
            for device in devices:
                value = read(device)
                if value is not None:
                    family.add_metric([str(device.index), device.uuid, device.name], float(value))
            yield family


class AgentMetrics:
    """Every metric the agent exports."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.gpus = GpuCollector()
        r.register(self.gpus)
        self.snapshot_fetches = Counter(
            "dctl_agent_snapshot_fetches", "Snapshot fetches by result.", ["result"], registry=r
        )
        self.snapshot_bytes = Counter(
            "dctl_agent_snapshot_fetched_bytes", "Bytes of verified snapshots fetched.", registry=r
        )
        self.snapshots_stored = Gauge(
            "dctl_agent_snapshots_stored", "Verified snapshots in the store.", registry=r
        )
        self.engine_starts = Counter(
            "dctl_agent_engine_starts", "Engine processes started or adopted.", registry=r
        )
        self.engine_restarts = Counter(
            "dctl_agent_engine_restarts", "Engine restarts after a crash or failed probes.",
            registry=r,
        )  # fmt: skip
        self.engine_transitions = Counter(
            "dctl_agent_engine_transitions", "Instance state changes by new state.", ["state"],
            registry=r,
        )  # fmt: skip
        self.instances = Gauge("dctl_agent_instances", "Instances by state.", ["state"], registry=r)
        self.heartbeats = Counter(
            "dctl_agent_heartbeats", "Heartbeats sent, by result.", ["result"], registry=r
        )
        self.log_lines_shipped = Counter(
            "dctl_agent_log_lines_shipped", "Log lines the control plane took, by source.",
            ["source"], registry=r,
        )  # fmt: skip
        self.log_lines_dropped = Counter(
            "dctl_agent_log_lines_dropped",
            "Log lines dropped: the buffer was full, or the control plane refused their batch.",
            registry=r,
        )
        self.log_lines_buffered = Gauge(
            "dctl_agent_log_lines_buffered", "Log lines waiting to be shipped.", registry=r
        )
        self.log_bytes_buffered = Gauge(
            "dctl_agent_log_buffered_bytes", "Bytes of log lines waiting to be shipped.",
            registry=r,
        )  # fmt: skip
        self.preflight_ok = Gauge(
            "dctl_agent_preflight_ok", "1 when the last preflight had no failure.", registry=r
        )
        for result in ("ok", "mismatch", "error"):
            self.snapshot_fetches.labels(result=result)
        for result in ("ok", "error"):
            self.heartbeats.labels(result=result)
        for source in ("engine", "agent"):
            self.log_lines_shipped.labels(source=source)

    def serve(self, port: int, host: str = "127.0.0.1", tls: tuple[str, str] | None = None) -> int:
        """Serve /metrics on HOST:PORT (0 picks a free port), over HTTPS with TLS (certificate,
        key); returns the port."""
        certfile, keyfile = tls or (None, None)
        server, _thread = start_http_server(
            port, addr=host, registry=self.registry, certfile=certfile, keyfile=keyfile
        )
        return int(server.server_address[1])
