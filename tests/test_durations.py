"""Durations: the one rule the CLI's options and the TUI's forms share, and how they show."""

from __future__ import annotations

import pytest

from runtime.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("5m", 300), ("24h", 86400), ("7d", 604800), (" 2 m ", 120)],
)
def test_a_positive_whole_number_and_a_unit_is_seconds(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "5", "m", "1.5h", "-3m", "5w", "5 minutes", "5M"])
def test_anything_else_is_refused(text: str) -> None:
    assert parse_duration(text) is None


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"), (-3, "0s"), (45.4, "45s"), (252, "4m12s"), (300, "5m"), (3720, "1h02m"),
        (7200, "2h"), (86400, "1d"), (90000, "1d01h"),
    ],
)  # fmt: skip
def test_a_duration_shows_in_two_units_at_most(seconds: float, shown: str) -> None:
    assert format_duration(seconds) == shown


@pytest.mark.parametrize("seconds", [45, 60, 300, 7200, 86400, 7 * 86400])
def test_a_whole_duration_shows_as_an_operator_types_it(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds
