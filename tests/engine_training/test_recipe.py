"""The training recipe's schedule: what a time budget turns into."""

from __future__ import annotations

from engine.training.train import Recipe, _steps_within, learning_rate


def test_a_time_budget_fixes_the_steps_after_the_warm_up_from_its_pace() -> None:
    # 50 warm-up steps took 6 s (0.12 s each); 90% of a 1-minute budget leaves 48 s: 400 more.
    recipe = _steps_within(Recipe(warmup=50, steps=1000), budget_minutes=1.0, elapsed_s=6.0)
    assert recipe.steps == 450
    # The warm-up's learning rates never depended on the total, so the run repeats with --steps.
    assert [learning_rate(recipe, s) for s in range(50)] == [
        learning_rate(Recipe(warmup=50, steps=1000), s) for s in range(50)
    ]
    # The schedule then decays to a tenth of the peak by the last step.
    assert abs(learning_rate(recipe, 449) - recipe.peak_lr / 10) < recipe.peak_lr * 1e-3


def test_a_budget_spent_by_the_warm_up_still_trains_one_more_step() -> None:
    assert _steps_within(Recipe(warmup=50), budget_minutes=0.1, elapsed_s=60.0).steps == 51
