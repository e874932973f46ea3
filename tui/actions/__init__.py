"""The TUI's actions on deployments and hosts: the keys and what each one sends (`rules`,
`canary`: pure, tested without a screen). `tui.actions.run.run_action`, which asks, confirms,
sends and shows, is not re-exported: this package imports without textual."""

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
]
