"""`run_action`: one action from key to answer — the form or list it needs, the confirmation,
the request, and the API's answer shown (a toast, or the error in a dialog)."""

from __future__ import annotations

from typing import Any

from textual.app import App

from client import AsyncControlPlaneClient, ClientError
from protocol.rollouts import RolloutCreate
from tui.actions.rules import (
    TITLES,
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


async def run_action(
    app: App[Any], client: AsyncControlPlaneClient, action: str, target: Target
) -> bool:
    """Run ACTION on TARGET: ask what it needs, confirm, send; True when the API accepted it.

    Must run in a worker (the dialogs are awaited). Nothing is sent when the action makes no
    sense for TARGET (a toast says why) or the user cancels; an API refusal (409, a viewer's
    403, a lost connection) opens an error dialog with its message and returns False.
    """
    # Imported here: the dialogs import this package's form rules, and either may load first.
    from tui.dialogs import ConfirmDialog, ErrorDialog

    why = refusal(action, target)
    if why is not None:
        app.notify(why, title=TITLES.get(action, action), severity="warning", markup=False)
        return False
    try:
        plan = await _plan(app, client, action, target)
        if plan is None or not await app.push_screen_wait(ConfirmDialog(plan.title, plan.question)):
            return False
        answer = await client.send(plan.call)
    except ClientError as exc:
        # Not awaited: the dialog stays until closed, the caller refreshes meanwhile.
        app.push_screen(ErrorDialog(f"{TITLES[action]} failed", str(exc)))
        return False
    app.notify(outcome_text(answer), title=plan.title, markup=False)
    return True


async def _plan(
    app: App[Any], client: AsyncControlPlaneClient, action: str, target: Target
) -> Plan | None:
    """The request ACTION makes, asking the form or list it needs; None when cancelled."""
    from tui.dialogs import CanaryForm, RollbackPicker

    if action == "canary":
        assert target.deployment is not None
        spec: RolloutCreate | None = await app.push_screen_wait(
            CanaryForm(target.deployment.name, target.versions)
        )
        return None if spec is None else canary_plan(target.deployment, spec)
    if action == "rollback":
        assert target.deployment is not None
        name = target.deployment.name
        choices = rollback_choices(target.deployment, target.rollout, target.versions)
        if not choices:
            app.notify(f"{name} has no other version to roll back to", severity="warning")
            return None
        picked: RollbackChoice | None = await app.push_screen_wait(RollbackPicker(name, choices))
        return None if picked is None else rollback_plan(target.deployment, picked, target.rollout)
    return plan_for(action, target)
