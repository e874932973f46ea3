"""The actions end to end: the real app on the real (seeded) control plane, keys pressed in the
deployment and host details. Each confirmed action reaches the API (asserted on the store) and
the screen shows the change; cancelling sends nothing; the API's refusals (a 409, a viewer's
403) are shown in a dialog, never a traceback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from textual.pilot import Pilot
from textual.widgets import Static

from protocol.rollout_states import RolloutState
from tests.tui.plane import Plane
from tui.app import DctlApp
from tui.dialogs import CanaryForm, ConfirmDialog, ErrorDialog, RollbackPicker


async def until(
    pilot: Pilot[Any], what: str, check: Callable[[], bool], timeout: float = 15
) -> None:
    """Let the app run until CHECK holds (the store is polled between frames)."""
    for _ in range(int(timeout / 0.1)):
        if check():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@asynccontextmanager
async def detail(
    plane: Plane, *, host: str | None = None, token: str | None = None
) -> AsyncIterator[tuple[DctlApp, Pilot[Any]]]:
    """The app on deployment web's detail (or HOST's), its data loaded."""
    app = DctlApp(plane.client(token), refresh_s=0.5)
    async with app.run_test(size=(120, 40)) as pilot:
        if host is None:
            await app.open_deployment("web")
        else:
            await app.open_host(host)
        await until(pilot, "the detail's data", lambda: app.screen.data is not None)
        yield app, pilot


def shown(app: DctlApp, selector: str) -> str:
    """The plain text of a Static on the current screen."""
    return str(app.screen.query_one(selector, Static).content)


async def confirm(app: DctlApp, pilot: Pilot[Any], *keys: str) -> str:
    """Press KEYS, expect the confirmation, answer `y`; returns its question."""
    await pilot.press(*keys)
    await until(pilot, "the confirmation", lambda: isinstance(app.screen, ConfirmDialog))
    question = shown(app, "#question")
    await pilot.press("y")
    return question


def toasts(app: DctlApp) -> list[str]:
    return [n.message for n in app._notifications]


async def test_abort_reaches_the_api_and_the_panel_shows_it(seeded: Plane) -> None:
    async with detail(seeded) as (app, pilot):
        assert RolloutState.PROGRESSING in shown(app, "#rollout")
        question = await confirm(app, pilot, "a")
        assert question.startswith("Abort web's rollout")
        await until(
            pilot,
            RolloutState.ABORTED,
            lambda: seeded.sync.get_rollout("web").state == RolloutState.ABORTED,
        )
        await until(pilot, "the panel", lambda: RolloutState.ABORTED in shown(app, "#rollout"))
        assert any(RolloutState.ABORTED in t for t in toasts(app))


async def test_pause_then_resume_by_the_rollouts_state(seeded: Plane) -> None:
    async with detail(seeded) as (app, pilot):
        assert (await confirm(app, pilot, "u")).startswith("Pause web's rollout")
        await until(
            pilot,
            RolloutState.PAUSED,
            lambda: seeded.sync.get_rollout("web").state == RolloutState.PAUSED,
        )
        await until(pilot, "the panel", lambda: RolloutState.PAUSED in shown(app, "#rollout"))
        assert (await confirm(app, pilot, "u")).startswith("Resume web's paused rollout")
        await until(
            pilot,
            "resumed",
            lambda: seeded.sync.get_rollout("web").state == RolloutState.PROGRESSING,
        )


async def test_promote_a_step_then_all_the_way(seeded: Plane) -> None:
    async with detail(seeded) as (app, pilot):
        await confirm(app, pilot, "p")
        await until(pilot, "step 2", lambda: seeded.sync.get_rollout("web").step == 2)
        await until(pilot, "the panel", lambda: "2/3" in shown(app, "#rollout"))
        assert "all the way" in await confirm(app, pilot, "P")
        await until(
            pilot, RolloutState.PROMOTED, lambda: seeded.sync.get_deployment("web").version == "v2"
        )


async def test_cancel_sends_nothing(plane: Plane) -> None:
    before = plane.sync.get_rollout("web")
    events = plane.sync.list_events(limit=1).next_cursor
    async with detail(plane) as (app, pilot):
        for keys in (("a", "n"), ("p", "escape"), ("c", "escape")):
            await pilot.press(*keys)
            await pilot.pause()
            assert not isinstance(app.screen, (ConfirmDialog, CanaryForm))
    after = plane.sync.get_rollout("web")
    assert (after.id, after.state, after.step) == (before.id, before.state, before.step)
    assert plane.sync.list_events(limit=1).next_cursor == events


async def test_a_canary_over_an_active_rollout_shows_the_409(plane: Plane) -> None:
    async with detail(plane) as (app, pilot):
        await pilot.press("c")
        await until(pilot, "the form", lambda: isinstance(app.screen, CanaryForm))
        await pilot.press(*"v3", "enter")
        await until(pilot, "the confirmation", lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await until(pilot, "the error", lambda: isinstance(app.screen, ErrorDialog))
        message = shown(app, "#message")
        assert "already has an active rollout" in message and "(HTTP 409)" in message
        await pilot.press("escape")
        assert not isinstance(app.screen, ErrorDialog)
    assert plane.sync.get_rollout("web").to == "demo:v2"  # the seeded one, untouched


async def test_a_canary_from_the_form_starts_a_rollout(seeded: Plane) -> None:
    seeded.sync.rollout_action("web", "abort", _reason())
    async with detail(seeded) as (app, pilot):
        await pilot.press("c")
        await until(pilot, "the form", lambda: isinstance(app.screen, CanaryForm))
        await pilot.press(*"demo:v3", "tab", "tab", "enter")  # enter from the steps field
        await until(pilot, "the confirmation", lambda: isinstance(app.screen, ConfirmDialog))
        await pilot.press("y")
        await until(pilot, "started", lambda: seeded.sync.get_rollout("web").to == "demo:v3")
        started = seeded.sync.get_rollout("web")
        assert (started.steps, started.policy.interval_s) == ([10, 50, 100], 300)
        await until(pilot, "the panel", lambda: "demo:v3" in shown(app, "#rollout"))


async def test_rollback_by_default_ends_the_rollout(seeded: Plane) -> None:
    async with detail(seeded) as (app, pilot):
        await pilot.press("b")
        await until(pilot, "the list", lambda: isinstance(app.screen, RollbackPicker))
        await pilot.press("enter")  # the default, first
        await until(pilot, "the confirmation", lambda: isinstance(app.screen, ConfirmDialog))
        assert shown(app, "#question").startswith("Roll web back to demo:v1, ending its rollout")
        await pilot.press("y")
        ended = seeded.sync.get_rollout
        await until(pilot, "rolled back", lambda: ended("web").state == RolloutState.ROLLED_BACK)


async def test_restart_the_selected_instance_only(seeded: Plane) -> None:
    seeded.sync.rollout_action("web", "abort", _reason())
    async with detail(seeded) as (app, pilot):
        await until(
            pilot, "no active rollout", lambda: RolloutState.ABORTED in shown(app, "#rollout")
        )
        selected = app.screen.table.selected_key
        question = await confirm(app, pilot, "R")
        assert question.startswith(f"Restart instance {selected} on gpu-")
        record = seeded.sync.get_rollout("web")
        assert record.kind == "restart"
        await until(
            pilot,
            "restarted",
            lambda: seeded.sync.get_rollout("web").state == RolloutState.COMPLETED,
        )
        assert "1 instance(s) restarted" in seeded.sync.get_rollout("web").reason


async def test_drain_and_undrain_a_host(seeded: Plane) -> None:
    async with detail(seeded, host="gpu-2") as (app, pilot):
        assert (await confirm(app, pilot, "n")).startswith("Drain gpu-2?")
        await until(pilot, "draining", lambda: seeded.sync.get_host("gpu-2").draining)
        await until(pilot, "the facts", lambda: "draining" in shown(app, "#facts"))
        assert (await confirm(app, pilot, "n")).startswith("Undrain gpu-2?")
        await until(pilot, "undrained", lambda: not seeded.sync.get_host("gpu-2").draining)


async def test_a_viewer_sees_the_403_in_a_dialog(plane: Plane) -> None:
    async with detail(plane, token=plane.viewer_token) as (app, pilot):
        await confirm(app, pilot, "a")
        await until(pilot, "the error", lambda: isinstance(app.screen, ErrorDialog))
        assert "(HTTP 403)" in shown(app, "#message")
        await pilot.press("escape")
        assert app.is_running
    assert plane.sync.get_rollout("web").state == RolloutState.PROGRESSING


def _reason() -> Any:
    from protocol.rollouts import RolloutAction

    return RolloutAction(reason="test")
