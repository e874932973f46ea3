"""The one duration rule the CLI's options and the TUI's forms share."""

from __future__ import annotations

import pytest

from runtime.durations import parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("5m", 300), ("24h", 86400), ("7d", 604800), (" 2 m ", 120)],
)
def test_a_positive_whole_number_and_a_unit_is_seconds(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0s", "5", "m", "1.5h", "-3m", "5w", "5 minutes", "5M"])
def test_anything_else_is_refused(text: str) -> None:
    assert parse_duration(text) is None
