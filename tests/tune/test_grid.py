"""The settings grid and the option syntax that names it."""

from __future__ import annotations

import pytest

from engine.tuning.grid import (
    DecodeSetting,
    GridError,
    build_grid,
    parse_block_sizes,
    parse_latency,
    parse_quality,
    parse_steps,
    parse_thresholds,
)


def test_lists_parse_in_the_order_given() -> None:
    assert parse_block_sizes("4, 8,16") == [4, 8, 16]
    assert parse_thresholds("0.5,0.95,1") == [0.5, 0.95, 1.0]
    assert parse_steps("2,1") == [2, 1]


@pytest.mark.parametrize(
    ("parse", "text", "needle"),
    [
        (parse_block_sizes, "4,,8", "comma-separated"),
        (parse_block_sizes, "", "comma-separated"),
        (parse_block_sizes, "0,4", ">= 1"),
        (parse_block_sizes, "4;8", ">= 1"),
        (parse_block_sizes, "4,4", "twice"),
        (parse_thresholds, "0.5,abc", "(0, 1]"),
        (parse_thresholds, "0", "(0, 1]"),
        (parse_thresholds, "1.5", "(0, 1]"),
        (parse_thresholds, "nan", "(0, 1]"),
        (parse_steps, "-1", ">= 1"),
        (parse_steps, "2.5", ">= 1"),
    ],
)
def test_bad_lists_name_the_option_and_the_fix(parse: object, text: str, needle: str) -> None:
    with pytest.raises(GridError) as caught:
        parse(text)  # type: ignore[operator]
    message = str(caught.value)
    assert message.startswith("--") and needle in message


def test_each_block_size_has_its_reference_first_then_thresholds_then_steps() -> None:
    settings, notes = build_grid([4, 8], [0.5, 0.9], [2, 8])
    assert [s.label for s in settings] == [
        "B4 ref", "B4 t=0.5", "B4 t=0.9", "B4 steps=2",
        "B8 ref", "B8 t=0.5", "B8 t=0.9", "B8 steps=2",
    ]  # fmt: skip
    # steps=8 > 4 is skipped for B=4 (said so); for B=8 it is the reference, measured once.
    assert notes == ["--steps 8 skipped for block size 4 (steps <= block size)"]
    reference = settings[0]
    assert reference.reference and reference.steps == reference.block_size == 4


def test_request_fields_pin_min_and_max_steps() -> None:
    # A server fills unset knobs from its own config: the sweep must send every one.
    assert DecodeSetting(8, threshold=0.9).request_fields() == {
        "block_size": 8, "min_steps": 1, "max_steps": 8, "threshold": 0.9,
    }  # fmt: skip
    assert DecodeSetting(8, steps=2).request_fields() == {
        "block_size": 8, "min_steps": 1, "max_steps": 8, "steps": 2,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "seconds"), [("500ms", 0.5), ("2s", 2.0), ("1.5s", 1.5), ("1m", 60.0)]
)
def test_latency_budget_units(text: str, seconds: float) -> None:
    assert parse_latency(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["2", "0s", "-1s", "2h", "fast"])
def test_bad_latency_budget_says_how_to_write_one(text: str) -> None:
    with pytest.raises(GridError, match=r"--latency-budget .*500ms, 2s or 1m"):
        parse_latency(text)


def test_quality_floor_is_in_zero_one() -> None:
    assert parse_quality("0.9") == 0.9
    for bad in ("0", "1.1", "high"):
        with pytest.raises(GridError, match="--min-quality"):
            parse_quality(bad)
