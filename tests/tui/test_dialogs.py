"""The actions' rules without a screen (the request each action builds, its confirmation, the
canary form's validation, the rollback list) and the dialogs in a bare app: `y` sends, `n` and
`esc` send nothing, `enter` submits the form from any field, the version input completes.

Requests go to an `httpx.MockTransport` that records them (the client's transport seam), so
these tests need no control plane; `test_actions.py` runs the same actions against a real one.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from textual.app import App
from textual.widgets import Input, Static

from client import AsyncControlPlaneClient
from protocol.rest import DeploymentOut, HostOut
from protocol.rollout_states import RolloutPhase, RolloutState
from protocol.rollouts import RolloutCreate, RolloutOut
from tui.actions import (
    ACTION_KEYS,
    CanaryFields,
    FieldError,
    RollbackChoice,
    Target,
    canary_plan,
    plan_for,
    read_canary,
    refusal,
    rollback_choices,
    rollback_plan,
)
from tui.actions.run import run_action
from tui.dialogs import CanaryForm, ConfirmDialog, ErrorDialog, RollbackPicker

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
VERSIONS = ("demo:v1", "demo:v2", "demo:v3")


def deployment(version: str = "v1", rollback_version: str | None = None) -> DeploymentOut:
    instance = {"deployment": "web", "version": version, "port": 9000, "desired_state": "running",
                "observed_state": "ready", "pid": 1, "restart_count": 0, "last_exit": None,
                "message": "", "observed_at": None}  # fmt: skip
    return DeploymentOut.model_validate({
        "id": 1, "name": "web", "model": "demo", "version": version, "placement": {},
        "instances_per_host": 1, "engine_config": {}, "created_at": NOW, "updated_at": NOW,
        "rollback_version": rollback_version, "instances": [{**instance, "id": 7, "host": "gpu-1"},
                      {**instance, "id": 8, "host": "gpu-2"}],
    })  # fmt: skip


def rollout(
    state: str = RolloutState.PROGRESSING, kind: str = "rollout", **extra: Any
) -> RolloutOut:
    return RolloutOut.model_validate({
        "id": 3, "deployment": "web", "kind": kind, "state": state, "step": 1,
        "steps": [10, 50, 100], "weight": 10, "from": "demo:v1", "to": "demo:v2",
        "engine_config_changed": False, "phase": RolloutPhase.ANALYSING, "canary_instances": 1,
        "canary_ready": 1, "stable_ready": 1, "step_started_at": NOW, "time_left_s": 60.0,
        "policy": {}, "analysis": None, "reason": "", "actor": "admin", "created_at": NOW,
        "updated_at": NOW, **extra,
    })  # fmt: skip


def host(draining: bool = False) -> HostOut:
    return HostOut.model_validate({
        "id": 1, "name": "gpu-1", "state": "ready", "draining": draining, "labels": {},
        "registered_at": NOW, "last_seen_at": NOW, "heartbeat_interval_s": 5.0,
        "port_range": (9000, 9100), "facts": None, "gpus": [], "desired_generation": 1,
        "applied_generation": 1,
    })  # fmt: skip


TARGET = Target(deployment(), rollout(), instance_id=8, versions=VERSIONS)


# --- the rules -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "target", "method", "path", "body"),
    [
        ("p", TARGET, "POST", "/deployments/web/rollout/promote", {"full": False}),
        ("P", TARGET, "POST", "/deployments/web/rollout/promote", {"full": True}),
        ("a", TARGET, "POST", "/deployments/web/rollout/abort", {"full": False}),
        ("u", TARGET, "POST", "/deployments/web/rollout/pause", {}),
        ("u", Target(deployment(), rollout(RolloutState.PAUSED)), "POST",
         "/deployments/web/rollout/resume", {}),
        ("r", TARGET, "POST", "/deployments/web/restart", {"instance": None, "host": None}),
        ("R", TARGET, "POST", "/deployments/web/restart", {"instance": 8}),
        ("n", Target(host=host()), "POST", "/hosts/gpu-1/drain", None),
        ("n", Target(host=host(draining=True)), "POST", "/hosts/gpu-1/undrain", None),
    ],
)  # fmt: skip
def test_each_key_builds_the_cli_request(
    key: str, target: Target, method: str, path: str, body: dict[str, Any] | None
) -> None:
    action = ACTION_KEYS[key]
    assert refusal(action, target) is None
    call = plan_for(action, target).call
    assert (call.method, call.path) == (method, f"/api/v1{path}")
    for field, value in (body or {}).items():
        assert call.json[field] == value


def test_the_confirmation_says_what_will_happen() -> None:
    assert "Pause web's rollout 3 (demo:v1 -> demo:v2, step 1/3 at 10%)" in (
        plan_for("pause_resume", TARGET).question
    )
    assert (
        "Resume"
        in plan_for("pause_resume", Target(deployment(), rollout(RolloutState.PAUSED))).question
    )
    assert "back to demo:v1" in plan_for("abort", TARGET).question
    assert "all the way to 100%" in plan_for("promote_full", TARGET).question
    assert plan_for("restart_instance", TARGET).question == "Restart instance 8 on gpu-2 of web?"
    assert plan_for("restart", TARGET).question.startswith("Restart all 2 instance(s) of web")
    assert plan_for("drain_toggle", Target(host=host())).question.startswith("Drain gpu-1?")
    spec = RolloutCreate(to="v3", steps=[20, 100], policy={"interval_s": 90})
    assert canary_plan(deployment(), spec).question == (
        "Start a canary rollout of web: demo:v1 -> demo:v3, steps 20,100%, each held 1m30s?"
    )


def test_actions_that_make_no_sense_are_refused_without_a_request() -> None:
    idle = Target(deployment(), None)
    for action in ("promote", "promote_full", "abort", "pause_resume"):
        assert refusal(action, idle) == "deployment web has no active rollout"
        assert refusal(action, Target(deployment(), rollout(RolloutState.PROMOTED))) is not None
    restart = Target(deployment(), rollout(RolloutState.PROGRESSING, kind="restart"))
    assert refusal("promote", restart) == "web's active restart has no steps to promote"
    assert refusal("abort", restart) is None
    assert "select an instance" in (refusal("restart_instance", Target(deployment())) or "")
    assert refusal("drain_toggle", Target(deployment())) == "select a host first"
    assert refusal("canary", Target(host=host())) == "select a deployment first"
    # Starting over an active rollout is the API's to refuse (409), shown as it says.
    assert refusal("canary", TARGET) is None and refusal("restart", TARGET) is None


def test_the_canary_form_makes_the_cli_request_or_names_every_wrong_field() -> None:
    spec = read_canary(CanaryFields(version="demo:v2"))
    assert isinstance(spec, RolloutCreate)
    assert (spec.to, spec.canary, spec.steps, spec.policy.interval_s) == (
        "demo:v2", 10, [10, 50, 100], 300,
    )  # fmt: skip
    plain = read_canary(CanaryFields(version="v3", canary="25%", steps="", interval=""))
    assert isinstance(plain, RolloutCreate)
    assert (plain.weights(), plain.policy.interval_s) == ([25, 50, 100], None)

    def errors(**fields: str) -> list[str]:
        result = read_canary(CanaryFields(**{"version": "v2", **fields}))
        assert isinstance(result, list)
        return [str(e) for e in result]

    assert errors(version=" ") == ["version: name the version to roll out, e.g. v2 or demo:v2"]
    assert errors(canary="0") == ["canary %: write a percent from 1 to 99, e.g. 10"]
    assert errors(steps="10,x") == ["steps: write rising percents ending at 100, e.g. 10,50,100"]
    assert errors(canary="20")[0].startswith("steps: the first step (10%) must be the canary %")
    assert errors(steps="10,50") == ["steps: the last step must be 100 (promotion), not 50"]
    assert errors(steps="10,5,100") == ["steps: step weights must rise: [10, 5, 100]"]
    assert errors(interval="5 minutes") == [
        "interval: write a duration like 30s, 5m or 1h (up to 24h)"
    ]
    assert [e.split(":")[0] for e in errors(version="", canary="x", interval="0s")] == [
        "version", "canary %", "interval",
    ]  # fmt: skip


def test_the_rollback_list_puts_the_apis_default_first() -> None:
    during = rollback_choices(deployment(), rollout(), VERSIONS)
    assert during[0] == RollbackChoice(
        "demo:v1 (default: end rollout 3, its canary goes away at once)", None
    )
    assert [c.to for c in during[1:]] == ["demo:v2", "demo:v3"]
    # After a promotion to v2 the control plane keeps v1 as the rollback target.
    after = rollback_choices(deployment("v2", rollback_version="v1"), None, VERSIONS)
    assert [(c.label, c.to) for c in after] == [
        ("demo:v1 (default: the kept rollback target)", None), ("demo:v3", "demo:v3"),
    ]  # fmt: skip
    never = rollback_choices(deployment(), None, VERSIONS)
    assert [c.to for c in never] == ["demo:v2", "demo:v3"]
    ending = rollback_plan(deployment(), during[0], rollout())
    assert ending.call.json["to"] is None
    assert ending.question == (
        "Roll web back to demo:v1, ending its rollout 3 (demo:v1 -> demo:v2, step 1/3 at 10%)? "
        "Its canary goes away at once."
    )
    picked = rollback_plan(deployment(), during[2])
    assert (picked.call.json["to"], picked.question) == (
        "demo:v3", "Roll web back from demo:v1 to demo:v3?",
    )  # fmt: skip


# --- the dialogs -----------------------------------------------------------------------------


class Recorder:
    """A fake control plane at the transport: records requests, answers with ANSWER."""

    def __init__(self, status: int = 200, answer: Any = None) -> None:
        self.sent: list[tuple[str, str, Any]] = []
        self.status = status
        self.answer = answer

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.sent.append((request.method, request.url.path, body))
        if request.method == "GET":  # the rollback list's history
            return httpx.Response(200, json=[])
        return httpx.Response(self.status, json=self.answer)

    def client(self) -> AsyncControlPlaneClient:
        return AsyncControlPlaneClient("http://plane", "t", transport=httpx.MockTransport(self))


class Harness(App[None]):
    """A bare app that runs one action in a worker as soon as it starts."""

    def __init__(self, recorder: Recorder, action: str, target: Target) -> None:
        super().__init__()
        self.client = recorder.client()
        self.action, self.target = action, target
        self.accepted: bool | None = None

    def on_mount(self) -> None:
        self.run_worker(self._go())

    async def _go(self) -> None:
        self.accepted = await run_action(self, self.client, self.action, self.target)


def toasts(app: App[Any]) -> list[str]:
    return [n.message for n in app._notifications]


async def test_y_sends_and_the_answer_is_a_toast() -> None:
    answered = rollout(RolloutState.PAUSED).model_dump(mode="json", by_alias=True)
    recorder = Recorder(answer=answered)
    app = Harness(recorder, "pause_resume", TARGET)
    async with app.run_test() as pilot:
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDialog)
        assert "Pause web's rollout 3" in str(app.screen.query_one("#question", Static).content)
        await pilot.press("y")
        await app.workers.wait_for_complete()
        assert app.accepted is True
        assert recorder.sent == [("POST", "/api/v1/deployments/web/rollout/pause",
                                  {"reason": "", "full": False})]  # fmt: skip
        assert toasts(app) == ["rollout 3 of web: paused, step 1/3 at 10%"]


@pytest.mark.parametrize("key", ["n", "escape"])
async def test_n_and_esc_send_nothing(key: str) -> None:
    recorder = Recorder()
    app = Harness(recorder, "abort", TARGET)
    async with app.run_test() as pilot:
        await pilot.pause()
        await pilot.press(key)
        await app.workers.wait_for_complete()
        assert (app.accepted, recorder.sent) == (False, [])
        assert not isinstance(app.screen, ConfirmDialog)


async def test_a_refusal_is_shown_in_an_error_dialog() -> None:
    recorder = Recorder(403, {"error": "forbidden", "message": "token 'v' (viewer) may not"})
    app = Harness(recorder, "restart", TARGET)
    async with app.run_test() as pilot:
        await pilot.pause()
        await pilot.press("y")
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.accepted is False
        assert isinstance(app.screen, ErrorDialog)
        message = str(app.screen.query_one("#message", Static).content)
        assert message == "token 'v' (viewer) may not (HTTP 403)"
        await pilot.press("escape")
        assert not isinstance(app.screen, ErrorDialog)


async def test_a_senseless_action_says_why_in_a_toast() -> None:
    recorder = Recorder()
    app = Harness(recorder, "restart_instance", Target(deployment(), None))
    async with app.run_test() as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.accepted is False and recorder.sent == []
        assert toasts(app) == ["select an instance first (R restarts the selected instance only)"]


async def test_the_canary_form_submits_from_any_field_and_reports_bad_ones() -> None:
    recorder = Recorder(201, rollout().model_dump(mode="json", by_alias=True))
    app = Harness(recorder, "canary", Target(deployment(), None, versions=VERSIONS))
    async with app.run_test() as pilot:
        await pilot.pause()
        form = app.screen
        assert isinstance(form, CanaryForm)
        # Completion from the model's versions: `→` takes the suggestion.
        await pilot.press("d", "e", "m", "o", ":", "v", "3", "right")
        assert form.query_one("#version", Input).value == "demo:v3"
        steps = form.query_one("#steps", Input)
        steps.value = "10,50"
        steps.focus()
        await pilot.press("enter")
        assert isinstance(app.screen, CanaryForm)  # not sent: the field is named
        shown = str(form.query_one("#errors", Static).content)
        assert shown == "steps: the last step must be 100 (promotion), not 50"
        assert recorder.sent == []
        steps.value = "10,50,100"
        form.query_one("#interval", Input).focus()
        await pilot.press("enter")  # from another field
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("y")
        await app.workers.wait_for_complete()
    method, path, body = recorder.sent[0]
    assert (method, path) == ("POST", "/api/v1/deployments/web/rollout")
    sent = (body["to"], body["steps"], body["policy"]["interval_s"])
    assert sent == ("demo:v3", [10, 50, 100], 300)


async def test_the_version_input_suggests_every_version() -> None:
    app = Harness(Recorder(), "canary", Target(deployment(), None, versions=VERSIONS))
    async with app.run_test() as pilot:
        await pilot.pause()
        version = app.screen.query_one("#version", Input)
        for typed, offered in (("demo:v2", "demo:v2"), ("V", "v1"), ("dem", "demo:v1")):
            version.value = ""
            await pilot.press(*typed, "right")
            assert version.value.lower() == offered
        await pilot.press("escape")
        await app.workers.wait_for_complete()
        assert app.accepted is False


async def test_the_rollback_list_picks_and_then_confirms() -> None:
    recorder = Recorder(201, rollout(kind="rollback").model_dump(mode="json", by_alias=True))
    app = Harness(recorder, "rollback", TARGET)
    async with app.run_test() as pilot:
        await pilot.pause()
        assert isinstance(app.screen, RollbackPicker)
        await pilot.press("down", "down", "enter")  # demo:v3
        await pilot.pause()
        assert isinstance(app.screen, ConfirmDialog)
        await pilot.press("y")
        await app.workers.wait_for_complete()
    rollback = {"to": "demo:v3", "all_at_once": False, "reason": ""}
    assert [sent[1:] for sent in recorder.sent] == [("/api/v1/deployments/web/rollback", rollback)]
    assert FieldError("steps", "x") != FieldError("steps", "y")  # frozen, comparable
