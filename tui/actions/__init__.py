"""The TUI's actions on deployments and hosts: the keys, what each one sends (`rules`, `canary`:
pure, tested without a screen) and `run_action`, which asks, confirms, sends and shows."""

from tui.actions.canary import CanaryFields, FieldError, read_canary
from tui.actions.rules import (
    ACTION_KEYS,
    Plan,
    RollbackChoice,
    Target,
    canary_plan,
    outcome_text,
    plan_for,
    refusal,
    rollback_choices,
    rollback_plan,
)
from tui.actions.run import run_action

__all__ = [
    "ACTION_KEYS",
    "CanaryFields",
    "FieldError",
    "Plan",
    "RollbackChoice",
    "Target",
    "canary_plan",
    "outcome_text",
    "plan_for",
    "read_canary",
    "refusal",
    "rollback_choices",
    "rollback_plan",
    "run_action",
]
