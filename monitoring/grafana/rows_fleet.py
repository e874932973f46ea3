"""Rows about the machines: hosts, agents, instances and snapshots; the GPUs themselves."""

from __future__ import annotations

from monitoring.grafana.dashboard import Panel, Row, Target
from monitoring.grafana.promql import HOST

FLEET = Row(
    "Fleet",
    (
        Panel(
            "Hosts by state",
            (Target("sum by (state) (dctl_hosts)", "{{state}}"),),
            "Hosts as the control plane sees them: not_ready after 3 missed heartbeats.",
        ),
        Panel(
            "Scrape targets up",
            (Target('sum by (role) (up{role!=""})', "{{role}}"),),
            "Targets Prometheus scraped successfully, by part of the fleet.",
        ),
        Panel(
            "Oldest heartbeat",
            (Target("max(dctl_heartbeat_lag_seconds)", "oldest heartbeat"),),
            "Age of the least recent heartbeat of a reachable host.",
            unit="s",
        ),
        Panel(
            "Engine instances by state",
            (Target(f"sum by (state) (dctl_agent_instances{{{HOST}}})", "{{state}}"),),
            "As the agents report them; crash_loop and failed need a look.",
        ),
        Panel(
            "Engine restarts (1h)",
            (
                Target(
                    f"sum by (host) (increase(dctl_agent_engine_restarts_total{{{HOST}}}[1h]))",
                    "{{host}}",
                ),
            ),
            "Restarts after a crash or failed probes, per host, over the last hour.",
        ),
        Panel(
            "Snapshot fetches (1h)",
            (
                Target(
                    "sum by (host, result) "
                    f"(increase(dctl_agent_snapshot_fetches_total{{{HOST}}}[1h]))",
                    "{{host}} {{result}}",
                ),
            ),
            "Fetches by result; a mismatch is a snapshot that failed verification.",
        ),
    ),
)

GPUS = Row(
    "GPUs",
    (
        Panel(
            "GPU utilisation",
            (Target(f"dctl_gpu_utilization_ratio{{{HOST}}}", "{{host}} GPU {{gpu}}"),),
            unit="percentunit",
        ),
        Panel(
            "GPU memory used",
            (
                Target(
                    f"dctl_gpu_memory_used_bytes{{{HOST}}} / dctl_gpu_memory_total_bytes{{{HOST}}}",
                    "{{host}} GPU {{gpu}}",
                ),
            ),
            "Alert above 95%.",
            unit="percentunit",
            threshold=0.95,
        ),
        Panel(
            "GPU temperature",
            (Target(f"dctl_gpu_temperature_celsius{{{HOST}}}", "{{host}} GPU {{gpu}}"),),
            "Warning above 85 °C, critical above 92 °C.",
            unit="celsius",
            threshold=85,
        ),
        Panel(
            "GPU power",
            (
                Target(f"dctl_gpu_power_watts{{{HOST}}}", "{{host}} GPU {{gpu}}"),
                Target(f"dctl_gpu_power_limit_watts{{{HOST}}}", "limit {{host}} GPU {{gpu}}"),
            ),
            unit="watt",
        ),
        Panel(
            "Uncorrectable ECC errors",
            (Target(f"dctl_gpu_ecc_uncorrected_errors{{{HOST}}}", "{{host}} GPU {{gpu}}"),),
            "Volatile count since the GPU's last reset; any is a reason to drain.",
            threshold=1,
        ),
        Panel(
            "GPUs lost",
            (Target(f"sum by (host) (1 - dctl_gpu_up{{{HOST}}})", "{{host}}"),),
            "GPUs the driver no longer answers for.",
            kind="stat",
            threshold=1,
        ),
    ),
)
