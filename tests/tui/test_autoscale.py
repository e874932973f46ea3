"""Autoscaling in the TUI: min/now/max in the deployments table and the deployment's header, the
last decision, pinned and starved in colour and in the alerts, standby and retiring instances
marked; on the canned answers (`tests.tui.canned`: `chat` is autoscaled) and a frozen clock."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import httpx
from rich.text import Text
from textual.pilot import Pilot
from textual.widgets import Static

from client import AsyncControlPlaneClient
from protocol.rest import DeploymentOut
from tests.tui import canned
from tui import health
from tui.app import DctlApp
from tui.views.deployment_detail import autoscale_text
from tui.views.deployments import autoscale_counts
from tui.widgets.table import ResourceTable


def starved_chat() -> dict[str, Any]:
    """`chat` pinned at its max of 4 for 12 minutes and starved for 5: no serving instance
    ready, below its min of 1."""
    chat = copy.deepcopy(canned.CHAT)
    chat["autoscale_status"].update(
        replicas=4,
        serving_ready=0,
        pinned_at_max_since=canned.at(720),
        starved_since=canned.at(300),
        starved_reason="no host of the placement has 1 free GPU (gpu-1: 0 free, gpu-2: 0 free)",
    )
    return chat


def client(chat: dict[str, Any] | None = None) -> AsyncControlPlaneClient:
    """The canned control plane, with CHAT in place of its `chat` deployment when given."""

    def handle(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if chat is not None and path == "/api/v1/deployments/chat":
            return httpx.Response(200, json=chat)
        if chat is not None and path == "/api/v1/deployments":
            return httpx.Response(200, json=[canned.DEPLOYMENT, chat])
        return canned.handler(request)

    transport = httpx.MockTransport(handle)
    return AsyncControlPlaneClient("http://cp.test:8700", "token", transport=transport)


async def until(pilot: Pilot[Any], what: str, check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def styles(text: Text, needle: str) -> set[str]:
    """The styles over the first occurrence of NEEDLE in TEXT."""
    start = text.plain.index(needle)
    return {str(s.style) for s in text.spans if s.start <= start < s.end}


async def test_the_table_shows_min_now_max_and_a_dash_for_a_fixed_count() -> None:
    app = DctlApp(client(), context_name="t", refresh_s=600, clock=canned.frozen)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.show_view("deployments")
        await until(pilot, "the deployments", lambda: app.screen.data is not None)
        table = app.screen.query_one("#deployments", ResourceTable)
        column = ["name", "model", "stable", "canary", "ready", "autoscale"].index("autoscale")
        assert table.cell_text("chat", column) == "1/2/4 +1"
        assert table.cell_text("web", column) == "-"


async def test_the_detail_shows_the_policy_the_last_decision_and_marks_instances() -> None:
    app = DctlApp(client(), context_name="t", refresh_s=600, clock=canned.frozen)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.open_deployment("chat")
        await until(pilot, "chat's data", lambda: app.screen.data is not None)
        lines = str(app.screen.query_one("#header", Static).render()).splitlines()
        assert lines[2] == (
            "autoscale 1/2/4 min/now/max +1 standby  serving 2/2 ready  standby 1/1 ready  "
            "queue/inst 0.5  busy 34%"
        )
        assert lines[3] == "last down 3->2 4m ago: 34% busy, under 80% for 10m"
        instances = app.screen.query_one("#instances", ResourceTable)
        role, load = 4, 6
        assert {k: instances.cell_text(k, role) for k in instances.keys} == {
            "3": "serving", "4": "serving", "5": "standby", "6": "retiring",
        }  # fmt: skip
        assert [instances.cell_text(k, load) for k in instances.keys] == ["6/1", "5/0", "-", "1/-"]
        standby, retiring = instances.get_row("5")[role], instances.get_row("6")[role]
        assert isinstance(standby, Text) and standby.style == "cyan"
        assert isinstance(retiring, Text) and retiring.style == "yellow"


async def test_pinned_and_starved_are_said_in_colour_with_what_to_do() -> None:
    app = DctlApp(client(starved_chat()), context_name="t", refresh_s=600, clock=canned.frozen)
    async with app.run_test(size=(120, 40)) as pilot:
        await app.open_deployment("chat")
        await until(pilot, "chat's data", lambda: app.screen.data is not None)
        shown = str(app.screen.query_one("#header", Static).render())
        assert "pinned at max for 12m: raise max or add GPUs" in shown
        assert "starved for 5m: no host of the placement has 1 free GPU" in shown
    text = autoscale_text(DeploymentOut.model_validate(starved_chat()), canned.NOW)
    # Below its min of one ready serving instance: red, the counts too; pinned: yellow.
    assert styles(text, "starved for") == {"red"}
    assert styles(text, "1/4/4") == {"red"}
    assert styles(text, "pinned at max") == {"yellow"}
    healthy = autoscale_text(DeploymentOut.model_validate(canned.CHAT), canned.NOW)
    assert styles(healthy, "1/2/4") == {"green"}


def test_the_autoscaler_colour_and_the_alerts() -> None:
    chat = DeploymentOut.model_validate(canned.CHAT)
    assert health.autoscale(chat) == "ok"
    assert health.autoscale(DeploymentOut.model_validate(canned.DEPLOYMENT)) == "idle"
    starved = DeploymentOut.model_validate(starved_chat())
    assert health.autoscale(starved) == "bad"
    assert status_level(starved, serving_ready=1) == "warn"  # starved, at least its min ready
    assert status_level(starved, serving_ready=1, starved_since=None) == "warn"  # pinned
    assert status_level(starved, starved_since=None, pinned_at_max_since=None) == "ok"
    alerts = health.alerts([], [starved, chat])
    assert [(a.level, a.subject, a.text) for a in alerts] == [
        ("bad", "chat", "starved: no host of the placement has 1 free GPU (gpu-1: 0 free, "
         "gpu-2: 0 free)"),
        ("warn", "chat", "autoscale pinned at max 4"),
    ]  # fmt: skip


def status_level(deployment: DeploymentOut, **status: Any) -> str:
    """health.autoscale of DEPLOYMENT with STATUS changed."""
    assert deployment.autoscale_status is not None
    changed = deployment.autoscale_status.model_copy(update=status)
    return health.autoscale(deployment.model_copy(update={"autoscale_status": changed}))


def test_counts_before_the_autoscaler_reports_are_the_serving_instances() -> None:
    chat = DeploymentOut.model_validate({**canned.CHAT, "autoscale_status": None})
    assert autoscale_counts(chat) == ("1/2/4", 1)  # instances 3 and 4; standby from the policy
    assert autoscale_counts(DeploymentOut.model_validate(canned.DEPLOYMENT)) is None
