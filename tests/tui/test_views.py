"""Every view against the real seeded control plane (`plane`, see `tests.tui.plane`): what it
shows, drilling down and back, `/` filters, `:` and ctrl+p, `?` help, read-only, and the banner
when the control plane goes away and comes back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from textual.pilot import Pilot
from textual.widgets import Input, Static, Tree

from client import AsyncControlPlaneClient
from tests.tui.plane import Plane
from tui.app import DctlApp
from tui.views.deployment_detail import DeploymentDetailScreen
from tui.views.deployments import DeploymentsScreen
from tui.views.help import HelpScreen
from tui.views.host_detail import HostDetailScreen
from tui.views.hosts import HostsScreen
from tui.views.overview import OverviewScreen
from tui.widgets.banner import StaleBanner
from tui.widgets.status_bar import StatusBar
from tui.widgets.table import ResourceTable


async def until(
    pilot: Pilot[Any], what: str, check: Callable[[], bool], timeout: float = 10
) -> None:
    """Let the app run until CHECK holds."""
    for _ in range(int(timeout / 0.05)):
        if check():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@asynccontextmanager
async def running(plane: Plane, **options: Any) -> AsyncIterator[tuple[DctlApp, Pilot[Any]]]:
    """The app on PLANE at 120x40, its first screen's data loaded."""
    app = DctlApp(plane.client(), context_name="tui-test", refresh_s=0.2, **options)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, "the overview's data", lambda: app.screen.data is not None)
        yield app, pilot


async def show(app: DctlApp, pilot: Pilot[Any], view: str) -> None:
    """Switch to VIEW and wait for its data."""
    await app.show_view(view)
    await until(pilot, f"{view}'s data", lambda: app.screen.data is not None)


def text(app: DctlApp, selector: str) -> str:
    """The plain text of a Static on the current screen."""
    return str(app.screen.query_one(selector, Static).render())


def table(app: DctlApp, selector: str | None = None) -> ResourceTable:
    """A table of the current screen (its main one by default)."""
    if selector is None:
        found = getattr(app.screen, "table", None)
        assert isinstance(found, ResourceTable)
        return found
    return app.screen.query_one(selector, ResourceTable)


def column(found: ResourceTable, index: int) -> list[str]:
    """The plain text of one column, top to bottom."""
    return [found.cell_text(key, index) for key in found.keys]


async def test_overview_shows_counts_tables_rollouts_events_and_alerts(plane: Plane) -> None:
    async with running(plane) as (app, _pilot):
        fleet = text(app, "#fleet")
        assert "2 ready" in fleet and "1 not ready" in fleet
        assert "instances" in fleet
        assert table(app, "#deployments").keys == ["web"]
        assert sorted(table(app, "#hosts").keys) == ["gpu-1", "gpu-2", "gpu-3"]
        rollouts = text(app, "#rollouts")
        assert "web" in rollouts and "demo:v1 -> demo:v2" in rollouts
        assert "step 1/3" in rollouts
        assert "gpu-3: host not_ready" in text(app, "#alerts")
        assert table(app, "#events").row_count > 0


async def test_hosts_table_and_host_detail(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        await show(app, pilot, "hosts")
        hosts = table(app)
        assert sorted(hosts.keys) == ["gpu-1", "gpu-2", "gpu-3"]
        states = dict(zip(hosts.keys, column(hosts, 1), strict=True))
        assert states["gpu-1"] == "ready" and states["gpu-3"] == "not_ready"
        assert dict(zip(hosts.keys, column(hosts, 3), strict=True))["gpu-1"] == "2"
        await app.open_host("gpu-2")
        await until(pilot, "gpu-2's detail", lambda: app.screen.data is not None)
        assert isinstance(app.screen, HostDetailScreen)
        gpus = table(app, "#gpus")
        assert gpus.keys == ["0", "1"]
        assert column(gpus, 6) == ["N/A", "N/A"]  # gpu-2's driver reports no power
        assert "%" in gpus.cell_text("0", 2)
        assert table(app, "#instances").row_count == 1
        facts = text(app, "#facts")
        assert "driver" in facts and "labels zone=a" in facts
        # The agent's own label is shown apart, with the command that would make it count.
        assert "reported, not adopted gpu=h9  (dctl host label gpu-2 --adopt)" in facts
        await pilot.press("escape")
        await until(pilot, "the hosts view", lambda: isinstance(app.screen, HostsScreen))


async def test_enter_on_deployments_opens_the_first_deployment(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        app.show_view("deployments")
        await pilot.press("enter")  # before the table's data arrived: it waits for it
        await until(pilot, "web's detail", lambda: isinstance(app.screen, DeploymentDetailScreen))
        await until(pilot, "web's data", lambda: app.screen.data is not None)
        assert sorted(column(table(app, "#instances"), 1)) == ["gpu-1", "gpu-2"]
        rollout = text(app, "#rollout")
        assert "demo:v1 -> demo:v2" in rollout and "step 1/3" in rollout
        assert "stable demo:v1" in text(app, "#header")
        await pilot.press("escape")
        await until(pilot, "the list", lambda: isinstance(app.screen, DeploymentsScreen))
        deployments = table(app)
        assert deployments.has_focus and deployments.cursor_row == 0
        assert deployments.cell_text("web", 1) == "demo"
        assert deployments.cell_text("web", 3).startswith("v2")  # the rollout's canary


async def test_models_tree_follows_version_lines(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        await show(app, pilot, "models")
        tree = app.screen.query_one(Tree)
        (demo,) = tree.root.children
        (v1,) = demo.children
        (v2,) = v1.children
        (v3,) = v2.children
        assert [str(n.label).split()[:2] for n in (v1, v2, v3)] == [
            ["v1", "base"],
            ["v2", "diffusion"],
            ["v3", "finetune"],
        ]
        assert "web (stable)" in str(v1.label)


async def test_events_newest_first_and_filtered(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        await show(app, pilot, "events")
        events = table(app)
        ids = [int(key) for key in events.keys]
        assert ids == sorted(ids, reverse=True) and len(ids) > 3
        await pilot.press("slash", *"gpu-3")
        assert 0 < events.row_count < len(ids)
        assert all("gpu-3" in " ".join(map(str, events.get_row(k))) for k in events.keys)
        await pilot.press("escape")
        assert events.row_count >= len(ids)


async def test_rollouts_history_and_hosts_filter(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        await show(app, pilot, "rollouts")
        history = table(app)
        assert history.row_count >= 1
        assert column(history, 0)[0] == "web"
        assert "demo:v2" in column(history, 4)[0]
        await show(app, pilot, "hosts")
        await pilot.press("slash", *"not_r", "enter")
        assert table(app).keys == ["gpu-3"]


async def test_command_line_completes_and_palette_lists_views(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        await pilot.press("colon", *"dep", "tab")
        assert app.screen.query_one(Input).value == "deployments"
        await pilot.press("enter")
        await until(pilot, "deployments", lambda: isinstance(app.screen, DeploymentsScreen))
        await pilot.press("ctrl+p", *"view: hosts")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until(pilot, "hosts", lambda: isinstance(app.screen, HostsScreen))


async def test_help_lists_every_key_of_the_view(plane: Plane) -> None:
    async with running(plane) as (app, pilot):
        await app.open_deployment("web")
        await pilot.press("question_mark")
        await until(pilot, "help", lambda: isinstance(app.screen, HelpScreen))
        assert isinstance(app.screen, HelpScreen)
        keys = {key for key, _ in app.screen.keys}
        assert {"c", "p", "P", "a", "u", "b", "r", "R", "esc", ":", "?", "q"} <= keys
        await pilot.press("escape")
        assert isinstance(app.screen, DeploymentDetailScreen)


async def test_readonly_has_no_action_keys_and_says_so(plane: Plane) -> None:
    async with running(plane, readonly=True) as (app, pilot):
        assert "read-only" in text(app, "StatusBar")
        await app.open_deployment("web")
        await until(pilot, "web's data", lambda: app.screen.data is not None)
        assert "read-only" in str(app.screen.query_one(StatusBar).render())
        bound = set(app.screen.active_bindings)
        assert not bound & {"c", "p", "P", "a", "u", "b", "r", "R"}
        await pilot.press("c")
        assert isinstance(app.screen, DeploymentDetailScreen)  # nothing opened
        await app.open_host("gpu-1")
        assert "n" not in app.screen.active_bindings


async def test_banner_when_the_control_plane_stops_and_recovers(seeded: Plane) -> None:
    async with running(seeded) as (app, pilot):
        banner = app.screen.query_one(StaleBanner)
        assert not banner.display or not banner.has_class("-stale")
        seeded.stop()
        await until(pilot, "the banner", lambda: banner.has_class("-stale"))
        shown = str(banner.render())
        assert shown.startswith("control plane unreachable — data from")
        assert "Traceback" not in shown
        assert table(app, "#deployments").keys == ["web"]  # the old data stays
        seeded.start()
        await until(pilot, "recovery", lambda: not banner.has_class("-stale"), timeout=15)


async def test_first_screen_at_once_and_a_slow_control_plane_in_the_banner() -> None:
    in_flight: list[str] = []

    async def never(request: httpx.Request) -> httpx.Response:
        in_flight.append(request.url.path)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    client = AsyncControlPlaneClient("http://cp.test", "t", transport=httpx.MockTransport(never))
    app = DctlApp(client, refresh_s=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        # "At once" is shown by order, not by a wall-clock bound (CI machines stall): the screen
        # is up while no answer has come back from the control plane.
        assert isinstance(app.screen, OverviewScreen)
        assert text(app, "#fleet") == "loading…"
        await until(pilot, "a request in flight", lambda: bool(in_flight), timeout=6)
        assert text(app, "#fleet") == "loading…"
        banner = app.screen.query_one(StaleBanner)
        await until(pilot, "the slow banner", lambda: banner.has_class("-stale"), timeout=6)
        assert str(banner.render()) == "control plane slow — no data yet"
