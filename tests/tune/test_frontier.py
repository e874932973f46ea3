"""The Pareto front and the recommendation, on hand-built results."""

from __future__ import annotations

import pytest

from engine.tuning.frontier import Criterion, mark_front, pareto_front, recommend
from engine.tuning.grid import DecodeSetting
from engine.tuning.scoring import SettingResult


def result(label: str, p50: float, agreement: float, p95: float | None = None) -> SettingResult:
    block, _, rest = label.partition(" ")
    setting = DecodeSetting(int(block[1:]), threshold=float(rest.removeprefix("t=")))
    return SettingResult(
        setting=setting,
        requests=4,
        p50_s=p50,
        p95_s=p95 if p95 is not None else p50 * 1.2,
        mean_s=p50,
        completion_tokens=100,
        throughput_tps=100 / p50,
        tokens_per_forward=None,
        engine_tokens_per_forward=None,
        agreement=agreement,
    )


# (label, p50 s, agreement): slow and exact -> fast and sloppy, one dominated point.
CURVE = [
    ("B8 t=0.95", 2.0, 1.00),
    ("B8 t=0.9", 1.0, 0.95),
    ("B8 t=0.8", 0.6, 0.80),
    ("B8 t=0.7", 1.5, 0.90),  # slower than t=0.9 and less faithful: dominated
    ("B8 t=0.5", 0.4, 0.50),
]


def curve() -> list[SettingResult]:
    return [result(*point) for point in CURVE]


def picked(results: list[SettingResult], criterion: Criterion) -> str | None:
    chosen = recommend(results, criterion)
    return None if chosen is None else chosen.setting.label


def test_front_holds_exactly_the_undominated_fastest_first() -> None:
    front = pareto_front(curve())
    assert [r.setting.label for r in front] == ["B8 t=0.5", "B8 t=0.8", "B8 t=0.9", "B8 t=0.95"]


def test_equal_points_are_both_on_the_front() -> None:
    twins = [result("B4 t=0.9", 1.0, 0.9), result("B8 t=0.9", 1.0, 0.9)]
    mark_front(twins)
    assert all(r.on_front for r in twins)


def test_quality_floor_picks_the_fastest_setting_that_meets_it() -> None:
    results = curve()
    assert picked(results, Criterion(min_quality=0.9)) == "B8 t=0.9"
    assert picked(results, Criterion(min_quality=0.8)) == "B8 t=0.8"
    assert picked(results, Criterion(min_quality=1.0)) == "B8 t=0.95"


def test_latency_budget_picks_the_best_quality_within_p95() -> None:
    results = curve()
    # p95 = 1.2 x p50: t=0.9 has p95 1.2 s, so a 1 s budget leaves t=0.8 as the best.
    assert picked(results, Criterion(latency_budget_s=1.0)) == "B8 t=0.8"
    assert picked(results, Criterion(latency_budget_s=1.2)) == "B8 t=0.9"


def test_ties_go_to_the_other_axis() -> None:
    fast_sloppy, fast_exact = result("B4 t=0.5", 1.0, 0.92), result("B4 t=0.9", 1.0, 0.97)
    assert recommend([fast_sloppy, fast_exact], Criterion(min_quality=0.9)) is fast_exact
    slow, quick = result("B4 t=0.9", 2.0, 0.9, p95=2.5), result("B8 t=0.9", 1.0, 0.9, p95=2.5)
    assert recommend([slow, quick], Criterion(latency_budget_s=3.0)) is quick


def test_nothing_meets_the_criterion_recommends_nothing() -> None:
    results = curve()
    assert recommend(results, Criterion(latency_budget_s=0.1)) is None
    assert recommend([result("B8 t=0.5", 0.4, 0.5)], Criterion(min_quality=0.9)) is None


def test_a_criterion_is_one_of_the_two() -> None:
    with pytest.raises(ValueError):
        Criterion()
    with pytest.raises(ValueError):
        Criterion(min_quality=0.9, latency_budget_s=1.0)
