"""What each TUI action does, as data: whether it makes sense for what is selected, the request
it sends, the question the confirmation asks, and the toast its answer becomes. No screen, no
I/O: `tui.actions.run` shows these and sends the request.

The requests are the CLI's (`cli/cmd_rollout.py`): `p` is `dctl rollout promote`, `P` adds
`--full`, `a` is `abort`, `u` `pause` or `resume` by the rollout's state, `b` is `dctl rollback`
(`--to` only when another version than the default is picked), `r` is `dctl restart`, `R`
`dctl restart --instance ID`, `n` `dctl host drain` / `undrain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from client import Call, calls
from client.calls import RolloutVerb
from protocol.rest import DeploymentOut, HostOut
from protocol.rollout_states import ACTIVE_STATES, CANARY_KINDS, RolloutKind, RolloutState
from protocol.rollouts import (
    RestartCreate,
    RollbackCreate,
    RolloutAction,
    RolloutCreate,
    RolloutOut,
)
from protocol.version_ref import VersionRef
from tui.format import duration

ACTION_KEYS: dict[str, str] = {
    "c": "canary",
    "p": "promote",
    "P": "promote_full",
    "a": "abort",
    "u": "pause_resume",
    "b": "rollback",
    "r": "restart",
    "R": "restart_instance",
    "n": "drain_toggle",
}
TITLES = {
    "canary": "Canary rollout",
    "promote": "Promote",
    "promote_full": "Promote --full",
    "abort": "Abort rollout",
    "pause_resume": "Pause / resume",
    "rollback": "Rollback",
    "restart": "Rolling restart",
    "restart_instance": "Restart instance",
    "drain_toggle": "Drain / undrain",
}
_STEERING = ("promote", "promote_full", "abort", "pause_resume")


@dataclass(frozen=True)
class Target:
    """What an action applies to: the selection of the view it was started from."""

    deployment: DeploymentOut | None = None
    rollout: RolloutOut | None = None  # the deployment's active rollout, if any
    instance_id: int | None = None  # selected instance row (for "R")
    host: HostOut | None = None  # for "n" drain/undrain
    versions: tuple[str, ...] = ()  # "model:version" choices (canary completion, rollback list)


@dataclass(frozen=True)
class RollbackChoice:
    """One entry of the rollback list: `to` None leaves the choice to the API (its default)."""

    label: str
    to: str | None


@dataclass(frozen=True)
class Plan:
    """A confirmed action's request: the dialog's title and question, and the call to make."""

    title: str
    question: str
    call: Call[Any]


def active(rollout: RolloutOut | None) -> RolloutOut | None:
    """ROLLOUT when it is still going (progressing or paused), else None."""
    return rollout if rollout is not None and rollout.state in ACTIVE_STATES else None


def refusal(action: str, target: Target) -> str | None:
    """Why ACTION makes no sense for TARGET (said in a toast, nothing sent), or None."""
    if action not in TITLES:
        return f"unknown action {action!r}"
    if action == "drain_toggle":
        return None if target.host is not None else "select a host first"
    if target.deployment is None:
        return "select a deployment first"
    name = target.deployment.name
    going = active(target.rollout)
    if action in _STEERING and going is None:
        return f"deployment {name} has no active rollout"
    if (
        action in ("promote", "promote_full")
        and going is not None
        and going.kind != RolloutKind.ROLLOUT
    ):
        return f"{name}'s active {going.kind} has no steps to promote"
    if action == "restart_instance" and target.instance_id is None:
        return "select an instance first (R restarts the selected instance only)"
    return None


def stable_ref(deployment: DeploymentOut) -> str:
    """The deployment's stable version as MODEL:VERSION."""
    return str(VersionRef(deployment.model, deployment.version))


def rollback_choices(
    deployment: DeploymentOut, rollout: RolloutOut | None, versions: Sequence[str]
) -> list[RollbackChoice]:
    """The rollback list, the API's default first: during a rollout, ending it (back to its
    `from`); else the rollback target the control plane keeps (`rollback_version`: what the
    last promotion or completed rollback replaced). Then every other version but the stable
    one."""
    stable = stable_ref(deployment)
    choices: list[RollbackChoice] = []
    going = active(rollout)
    if going is not None and going.kind in CANARY_KINDS:
        default: str | None = going.from_
        label = f"{going.from_} (default: end rollout {going.id}, its canary goes away at once)"
        choices.append(RollbackChoice(label, None))
    else:
        kept = deployment.rollback_version
        default = str(VersionRef(deployment.model, kept)) if kept else None
        if default is not None and default != stable:
            choices.append(RollbackChoice(f"{default} (default: the kept rollback target)", None))
    for version in versions:
        if version not in (stable, default):
            choices.append(RollbackChoice(version, version))
    return choices


def _rollout_line(rollout: RolloutOut) -> str:
    return (
        f"{rollout.kind} {rollout.id} ({rollout.from_} -> {rollout.to}, "
        f"step {rollout.step}/{len(rollout.steps)} at {rollout.weight}%)"
    )


def canary_plan(deployment: DeploymentOut, spec: RolloutCreate) -> Plan:
    """Start the canary rollout SPEC of DEPLOYMENT."""
    to = spec.to or ""
    ref = to if ":" in to else str(VersionRef(deployment.model, to))
    every = spec.policy.interval_s
    held = f", each held {duration(every)}" if every is not None else ""
    steps = ",".join(str(w) for w in spec.weights())
    question = (
        f"Start a canary rollout of {deployment.name}: {stable_ref(deployment)} -> {ref}, "
        f"steps {steps}%{held}?"
    )
    return Plan(TITLES["canary"], question, calls.start_rollout(deployment.name, spec))


def rollback_plan(
    deployment: DeploymentOut, choice: RollbackChoice, rollout: RolloutOut | None = None
) -> Plan:
    """Roll DEPLOYMENT back as CHOICE says (`to` None: the API's default, which during the
    active ROLLOUT ends it)."""
    spec = RollbackCreate(to=choice.to)
    going = active(rollout)
    if choice.to is None and going is not None and going.kind in CANARY_KINDS:
        question = (
            f"Roll {deployment.name} back to {going.from_}, ending its {_rollout_line(going)}? "
            "Its canary goes away at once."
        )
    else:
        target = choice.to or choice.label.split(" (", 1)[0]
        question = f"Roll {deployment.name} back from {stable_ref(deployment)} to {target}?"
    return Plan(TITLES["rollback"], question, calls.rollback(deployment.name, spec))


def plan_for(action: str, target: Target) -> Plan:
    """The request of every action but canary and rollback (which need the form's answer:
    `canary_plan`, `rollback_plan`); call only when `refusal` is None."""
    title = TITLES[action]
    if action == "drain_toggle":
        assert target.host is not None
        host = target.host.name
        if target.host.draining:
            return Plan(title, f"Undrain {host}? It takes instances again.",
                        calls.undrain_host(host))  # fmt: skip
        question = f"Drain {host}? Its instances stop and nothing new is placed there."
        return Plan(title, question, calls.drain_host(host))
    assert target.deployment is not None
    name = target.deployment.name
    if action == "restart":
        count = len(target.deployment.instances)
        question = f"Restart all {count} instance(s) of {name}, one at a time?"
        return Plan(title, question, calls.restart(name, RestartCreate()))
    if action == "restart_instance":
        assert target.instance_id is not None
        where = {i.id: i.host for i in target.deployment.instances}.get(target.instance_id)
        on = f" on {where}" if where else ""
        question = f"Restart instance {target.instance_id}{on} of {name}?"
        only = RestartCreate(instance=target.instance_id)
        return Plan(title, question, calls.restart(name, only))
    going = active(target.rollout)
    assert going is not None
    line = _rollout_line(going)
    verb: RolloutVerb
    if action == "promote":
        verb, body = "promote", RolloutAction()
        question = f"Promote {name}'s {line} to its next step now?"
    elif action == "promote_full":
        verb, body = "promote", RolloutAction(full=True)
        question = f"Promote {name}'s {line} all the way to 100% now, skipping the remaining steps?"
    elif action == "abort":
        verb, body = "abort", RolloutAction()
        question = f"Abort {name}'s {line}? Every request goes back to {going.from_}."
    elif going.state == RolloutState.PAUSED:
        verb, body, question = "resume", RolloutAction(), f"Resume {name}'s paused {line}?"
    else:
        verb, body = "pause", RolloutAction()
        question = f"Pause {name}'s {line}? It holds its step: no analysis, no promotion."
    return Plan(title, question, calls.rollout_action(name, verb, body))


def outcome_text(answer: object) -> str:
    """The success toast for what the API answered."""
    if isinstance(answer, RolloutOut):
        where = f"{answer.kind} {answer.id} of {answer.deployment}: {answer.state}"
        if not answer.steps:
            return where
        return f"{where}, step {answer.step}/{len(answer.steps)} at {answer.weight}%"
    if isinstance(answer, HostOut):
        return f"host {answer.name}: {'draining' if answer.draining else 'takes instances again'}"
    return "done"
