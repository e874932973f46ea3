"""An analysis row carries its unit, so the CLI and the TUI show a figure alike without reading
the unit from the metric's name."""

from __future__ import annotations

import pytest

from protocol.rollouts import MetricVerdict


def test_a_row_keeps_the_unit_it_was_written_with() -> None:
    row = MetricVerdict(
        metric="p95 latency", unit="seconds", stable=0.2, canary=0.3, limit="<= 1.25x stable",
        verdict="pass",
    )  # fmt: skip
    assert MetricVerdict.model_validate(row.model_dump(mode="json")).unit == "seconds"


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        ("error rate", "ratio"),
        ("p95 latency (s)", "seconds"),
        ("p95 TTFT (s)", "seconds"),
        ("steps per block", "number"),
        ("tokens per forward", "number"),
        ("canary restarts", "count"),
    ],
)
def test_rows_stored_before_units_get_theirs_by_name(name: str, unit: str) -> None:
    stored = {"metric": name, "stable": 1.0, "canary": 1.0, "limit": "-", "verdict": "pass"}
    assert MetricVerdict.model_validate(stored).unit == unit


def test_a_unit_is_one_of_the_known_ones() -> None:
    row = {"metric": "x", "unit": "furlongs", "stable": None, "canary": None, "limit": "-",
           "verdict": "pass"}  # fmt: skip
    with pytest.raises(ValueError, match="unit"):
        MetricVerdict.model_validate(row)
