"""SVG snapshots of the main views at 120x40 and 80x24, on canned answers (`tests.tui.canned`)
and a frozen clock so each run draws the same picture. `--snapshot-update` rewrites them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from tests.tui.canned import canned_client, frozen
from tui.app import DctlApp

SIZES = [(120, 40), (80, 24)]
Navigate = Callable[[DctlApp], Awaitable[Any]]


def app() -> DctlApp:
    # A long period: one refresh per view, so the sparklines never grow between frames.
    return DctlApp(canned_client(), context_name="prod", refresh_s=600, clock=frozen)


def loaded(go: Navigate | None) -> Callable[[Pilot[Any]], Awaitable[None]]:
    """A `run_before` that goes to a view with GO and waits for its data."""

    async def run_before(pilot: Pilot[Any]) -> None:
        dctl = pilot.app
        assert isinstance(dctl, DctlApp)
        if go is not None:
            await go(dctl)
        for _ in range(100):
            if getattr(dctl.screen, "data", None) is not None:
                break
            await pilot.pause(0.05)
        # Under `app.run(headless=True)` a table's first rows keep the header's column widths
        # until the rows are shown again (a terminal, and `run_test`, size them at once): show
        # the same data again, as the next refresh would.
        screen = dctl.screen
        show = getattr(screen, "show", None)
        if show is not None and getattr(screen, "data", None) is not None:
            show(screen.data)
        await pilot.pause()

    return run_before


VIEWS: dict[str, Navigate | None] = {
    "overview": None,
    "hosts": lambda a: a.show_view("hosts"),
    "deployments": lambda a: a.show_view("deployments"),
    "deployment_detail": lambda a: a.open_deployment("web"),
    # Autoscaled: min/now/max and the last decision; standby and retiring instances marked.
    "deployment_detail_autoscaled": lambda a: a.open_deployment("chat"),
}


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("view", list(VIEWS))
def test_view_snapshot(snap_compare: Any, view: str, size: tuple[int, int]) -> None:
    assert snap_compare(app(), terminal_size=size, run_before=loaded(VIEWS[view]))
