"""`DctlApp`: the dashboard's shell. One mode per top-level view (`show_view`), detail screens
pushed over it (`open_host`, `open_deployment`), `:` / ctrl+p to switch, `?` for keys."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen
from textual.widget import Widget

from client import AsyncControlPlaneClient
from tui.commands import VIEWS, ViewCommands
from tui.health import Thresholds
from tui.link import Link
from tui.views.command_line import CommandLine
from tui.views.deployment_detail import DeploymentDetailScreen
from tui.views.deployments import DeploymentsScreen
from tui.views.events import EventsScreen
from tui.views.help import HelpScreen
from tui.views.host_detail import HostDetailScreen
from tui.views.hosts import HostsScreen
from tui.views.models import ModelsScreen
from tui.views.overview import OverviewScreen
from tui.views.rollouts import RolloutsScreen


def _utc_now() -> datetime:
    return datetime.now(UTC)


class DctlApp(App[None]):
    """The terminal dashboard of one control plane, reached through CLIENT."""

    CSS_PATH = "app.tcss"
    TITLE = "dctl"
    MODES: ClassVar[dict[str, Callable[[], Screen[Any]]]] = {
        "overview": OverviewScreen,
        "hosts": HostsScreen,
        "deployments": DeploymentsScreen,
        "models": ModelsScreen,
        "events": EventsScreen,
        "rollouts": RolloutsScreen,
    }
    DEFAULT_MODE = "overview"
    COMMANDS = App.COMMANDS | {ViewCommands}
    # Narrow terminals stack the overview's panels; wide ones put them side by side.
    HORIZONTAL_BREAKPOINTS: ClassVar[list[tuple[int, str]]] = [(0, "-narrow"), (110, "-wide")]
    BINDINGS: ClassVar[list[Any]] = [
        Binding("colon", "command_line", "View", key_display=":"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+q", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(
        self,
        client: AsyncControlPlaneClient,
        *,
        context_name: str = "",
        readonly: bool = False,
        refresh_s: float = 2.0,
        clock: Callable[[], datetime] | None = None,
        thresholds: Thresholds | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.context_name = context_name
        self.readonly = readonly
        self.refresh_s = refresh_s
        self.thresholds = thresholds or Thresholds()
        self.link = Link()
        self._clock = clock or _utc_now
        self.sub_title = context_name

    def now(self) -> datetime:
        """The app's clock (frozen in snapshot tests)."""
        return self._clock()

    # --- navigation ------------------------------------------------------------------------

    def show_view(self, name: str) -> Any:
        """Switch to top-level view NAME (one of `tui.commands.VIEWS`); awaitable."""
        if name not in VIEWS:
            raise ValueError(f"no view {name!r}; views: {', '.join(VIEWS)}")
        return self.switch_mode(name)

    def open_deployment(self, name: str) -> Any:
        """Push deployment NAME's detail over the current view; awaitable."""
        return self.push_screen(DeploymentDetailScreen(name))

    def open_host(self, name: str) -> Any:
        """Push host NAME's detail over the current view; awaitable."""
        return self.push_screen(HostDetailScreen(name))

    def action_command_line(self) -> None:
        """`:`: ask for a view name."""
        self.push_screen(CommandLine(), self._command_chosen)

    def _command_chosen(self, choice: str | None) -> None:
        if choice == "quit":
            self.exit()
        elif choice is not None:
            self.show_view(choice)

    def action_help(self) -> None:
        """`?`: the keys of the view on screen."""
        screen = self.screen
        if isinstance(screen, HelpScreen):
            return
        self.push_screen(HelpScreen(getattr(screen, "TITLE", "") or "dctl", self.keys_of(screen)))

    def keys_of(self, screen: Screen[Any]) -> list[tuple[str, str]]:
        """Every key SCREEN answers to (its own and the app's), with what it does."""
        found: list[tuple[str, str]] = []
        if getattr(screen, "table", None) is not None:
            found += [("enter", "open the selected row"), ("↑ ↓", "move")]
        for active in screen.active_bindings.values():
            if isinstance(active.node, Widget) and not isinstance(active.node, Screen):
                continue  # a focused widget's own keys (cursor moves, typing)
            binding = active.binding
            if binding.action in ("open_selected", "command_palette"):
                continue
            found.append((self.get_key_display(binding), binding.description or binding.action))
        found.append(("ctrl+p", "command palette: views"))
        return found
