"""Which settings are worth running: the Pareto front and the recommendation.

Pure rules over measured results, no I/O. A setting is on the front when no other one is at
least as fast (p50) and at least as faithful (agreement) and strictly better at one of them.
The recommendation follows one criterion:

- a quality floor (`--min-quality Q`): the fastest setting (lowest p50) with agreement >= Q;
- a latency budget (`--latency-budget D`): the most faithful setting with p95 <= D.

Ties go to the other axis (higher agreement, then lower p50), then to more tokens per forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.tuning.scoring import SettingResult


def dominates(a: SettingResult, b: SettingResult) -> bool:
    """Whether A is at least as good as B on both axes and strictly better on one."""
    no_worse = a.p50_s <= b.p50_s and a.agreement >= b.agreement
    better = a.p50_s < b.p50_s or a.agreement > b.agreement
    return no_worse and better


def pareto_front(results: Sequence[SettingResult]) -> list[SettingResult]:
    """The results no other result dominates, fastest first."""
    front = [r for r in results if not any(dominates(o, r) for o in results if o is not r)]
    return sorted(front, key=lambda r: (r.p50_s, -r.agreement))


def mark_front(results: Sequence[SettingResult]) -> None:
    """Set `on_front` on every result."""
    front = {id(r) for r in pareto_front(results)}
    for r in results:
        r.on_front = id(r) in front


@dataclass(frozen=True)
class Criterion:
    """What the recommendation must satisfy: a quality floor or a latency budget (p95)."""

    min_quality: float | None = None
    latency_budget_s: float | None = None

    def __post_init__(self) -> None:
        if (self.min_quality is None) == (self.latency_budget_s is None):
            raise ValueError("a criterion is a quality floor or a latency budget, exactly one")

    def describe(self) -> str:
        """`agreement >= 0.9` or `p95 <= 2 s`."""
        if self.min_quality is not None:
            return f"agreement >= {self.min_quality:g}"
        return f"p95 latency <= {self.latency_budget_s:g} s"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"min_quality": self.min_quality, "latency_budget_s": self.latency_budget_s}


def _speed(r: SettingResult) -> float:
    return r.tokens_per_forward or r.throughput_tps


def recommend(results: Sequence[SettingResult], criterion: Criterion) -> SettingResult | None:
    """The setting to run under CRITERION, or None when no setting meets it."""
    if criterion.min_quality is not None:
        floor = criterion.min_quality
        eligible = [r for r in results if r.agreement >= floor]
        return min(eligible, key=lambda r: (r.p50_s, -r.agreement, -_speed(r)), default=None)
    budget = criterion.latency_budget_s or 0.0
    eligible = [r for r in results if r.p95_s <= budget]
    return min(eligible, key=lambda r: (-r.agreement, r.p50_s, -_speed(r)), default=None)
