"""The sweep over a fake runner: order, warm-ups, scoring against each block size's reference,
and the sentences a person reads at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.tuning.frontier import Criterion, mark_front, recommend
from engine.tuning.grid import DecodeSetting, build_grid
from engine.tuning.scoring import Batch, RequestSample
from engine.tuning.summary import recommendation_lines, table_rows
from engine.tuning.sweep import run_sweep


class FakeRunner:
    """Answers [1, 2, 3, 4] at steps = block size; fewer steps get the last token wrong."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.calls: list[str] = []

    def describe(self) -> dict[str, Any]:
        return {}

    def warm_up(self, setting: DecodeSetting) -> None:
        self.calls.append(f"warm B{setting.block_size}")

    def run(self, setting: DecodeSetting, *, max_tokens: int, concurrency: int) -> Batch:
        self.calls.append(setting.label)
        exact = setting.steps == setting.block_size
        units = [1, 2, 3, 4] if exact else [1, 2, 3, 9]
        latency = 1.0 if exact else 0.5
        sample = RequestSample(e2e_s=latency, completion_tokens=4, units=units, denoise_steps=2)
        return Batch([sample, sample], wall_s=2 * latency)

    def heldout_accuracy(self, setting: DecodeSetting) -> float | None:
        return None


def test_each_block_size_is_warmed_then_measured_reference_first() -> None:
    settings, _ = build_grid([4, 8], [0.9], [])
    runner = FakeRunner()
    lines: list[str] = []
    results = run_sweep(runner, settings, max_tokens=8, concurrency=1, progress=lines.append)
    assert runner.calls == ["warm B4", "B4 ref", "B4 t=0.9", "warm B8", "B8 ref", "B8 t=0.9"]
    assert [r.agreement for r in results] == [1.0, 0.75, 1.0, 0.75]
    assert [line.split()[0] for line in lines] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]


def test_a_setting_before_its_reference_is_refused() -> None:
    with pytest.raises(ValueError, match="before the reference"):
        run_sweep(
            FakeRunner(),
            [DecodeSetting(4, threshold=0.9)],
            max_tokens=8,
            concurrency=1,
            progress=lambda line: None,
        )


def test_recommendation_sentences() -> None:
    settings, _ = build_grid([4], [0.9], [2])
    results = run_sweep(
        FakeRunner(), settings, max_tokens=8, concurrency=1, progress=lambda line: None
    )
    mark_front(results)
    strict = Criterion(min_quality=0.99)
    chosen = recommend(results, strict)
    assert chosen is not None and chosen.setting.label == "B4 ref"
    rows = table_rows(results, chosen)
    assert [row["pick"] for row in rows] == [">", " ", " "]
    lines = recommendation_lines(
        results, chosen, strict, Path("out/cfg.yaml"), model_dir=None, deployment="prod"
    )
    assert lines[0].startswith("recommended: B4 ref, the fastest (p50) setting with agreement")
    # The keys go into the deployment's whole config (a rollout's --engine-config replaces it):
    # --apply merges them; by hand, into FILE.
    assert "run again with --apply" in lines[1] and "out/cfg.yaml" in lines[1]
    assert lines[-1] == "  dctl rollout prod --engine-config FILE --canary 10%"
    applying = recommendation_lines(
        results, chosen, strict, Path("out/cfg.yaml"), model_dir=None, deployment="prod",
        applying=True,
    )  # fmt: skip
    assert applying[-1] == "applying it to prod (--apply): a 10% config rollout"
    faster = results[1:]  # without the reference
    assert recommend(faster, Criterion(min_quality=0.9)) is None
    nothing = recommendation_lines(
        faster, None, Criterion(min_quality=0.9), Path("c"), model_dir=None, deployment=None
    )
    assert nothing == [
        "no setting meets agreement >= 0.9: the best agreement is 0.750 (B4 t=0.9); lower "
        "--min-quality, or add more careful settings (higher --thresholds, more --steps). "
        "Nothing recommended."
    ]
