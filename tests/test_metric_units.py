"""The unit rule the CLI and the TUI share for rollout analysis figures."""

from __future__ import annotations

import pytest

from protocol.metric_units import metric_unit


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        ("error rate", "ratio"),
        ("p95 latency (s)", "seconds"),
        ("p95 TTFT (s)", "seconds"),
        ("steps per block", "number"),
        ("canary restarts", "count"),
        ("requests", "count"),
        ("step_s", "seconds"),
    ],
)
def test_names_the_control_plane_writes(name: str, unit: str) -> None:
    assert metric_unit(name) == unit
