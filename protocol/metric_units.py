"""What unit an analysis figure is in, read from its metric's name.

A row of a rollout analysis (`MetricVerdict`) carries a name and two numbers, no unit: the
names the control plane writes say it (`error rate`, `p95 latency (s)`, `p95 TTFT (s)`,
`canary restarts`). One rule, so the CLI and the TUI show a figure alike, each in its own style.
"""

from __future__ import annotations

from typing import Literal

MetricUnit = Literal["ratio", "seconds", "count", "number"]


def metric_unit(name: str) -> MetricUnit:
    """ratio (a rate: show it in %), seconds (latencies: ms), count (whole) or number."""
    lowered = name.lower()
    if "rate" in lowered:
        return "ratio"
    if lowered.endswith(("(s)", "_s")) or "latency" in lowered or "ttft" in lowered:
        return "seconds"
    if "restarts" in lowered or "requests" in lowered:
        return "count"
    return "number"
