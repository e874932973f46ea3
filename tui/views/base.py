"""What every view shares: the title, the stale-data banner, the refresh worker, the `/` filter
and the status line.

A view says what to fetch (`fetch`) and how to show it (`show`); this class runs `fetch` in a
worker every `refresh_s` while the view is on screen, never two at once, and posts the result
back as a message, so all I/O stays in workers and all widget changes in handlers.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from client import AsyncControlPlaneClient, ClientError
from protocol.plain_text import printable
from tui.messages import DataArrived, RefreshFailed
from tui.widgets.banner import StaleBanner
from tui.widgets.filter_bar import FilterBar
from tui.widgets.status_bar import StatusBar
from tui.widgets.table import ResourceTable

if TYPE_CHECKING:
    from tui.app import DctlApp


class ViewScreen(Screen[None]):
    """A view of the fleet that refreshes itself; subclasses give `fetch`, `show`, `body`."""

    TITLE: ClassVar[str] = ""
    HAS_FILTER: ClassVar[bool] = False
    BINDINGS: ClassVar[list[Any]] = [
        Binding("enter", "open_selected", "Open", show=False),
        Binding("escape", "back", "Back", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.data: Any = None
        self._waiting_since: datetime | None = None
        self._again = False  # an action changed things while a refresh was under way

    @property
    def dctl(self) -> DctlApp:
        """The app, typed."""
        from tui.app import DctlApp

        assert isinstance(self.app, DctlApp)
        return self.app

    # --- what a view defines ---------------------------------------------------------------

    def body(self) -> ComposeResult:
        """The view's own widgets."""
        yield from ()

    async def fetch(self, client: AsyncControlPlaneClient) -> Any:
        """Fetch what the view shows (runs in the refresh worker)."""
        raise NotImplementedError

    def show(self, data: Any) -> None:
        """Render DATA (the last `fetch`'s result) into the widgets."""

    def title_text(self) -> str:
        """The title line."""
        return self.TITLE

    @property
    def table(self) -> ResourceTable | None:
        """The table `/` filters and `enter` drills into, if the view has one."""
        return None

    async def open_row(self, table: ResourceTable, key: str) -> None:
        """Drill down into row KEY of TABLE (views with details override it)."""

    # --- shared machinery ------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        """Title, banner, the view's body, filter, status line and keys."""
        yield Static(printable(self.title_text()), id="title", markup=False)
        yield StaleBanner(id="banner", markup=False)
        yield from self.body()
        if self.HAS_FILTER:
            yield FilterBar()
        with Vertical(id="bottom"):
            yield StatusBar(id="status", markup=False)
            yield Footer()

    def on_mount(self) -> None:
        """Start refreshing: now, then every `refresh_s`; the banner's age ticks every second."""
        app = self.dctl
        self.query_one(StatusBar).show(app.context_name, self.TITLE, app.refresh_s, app.readonly)
        self.set_interval(app.refresh_s, self.refresh_data)
        self.set_interval(1.0, self.update_banner)
        self.refresh_data()
        self.focus_table()

    def on_screen_resume(self) -> None:
        """Back on screen: refresh at once rather than show data a hidden view kept."""
        self.update_banner()
        if self.data is not None:
            self.refresh_data()
        self.focus_table()

    def focus_table(self) -> None:
        """Focus the view's table, if it has one, with its cursor on the first row."""
        table = self.table
        if table is not None and self.focused is None:
            table.focus()

    def refresh_data(self, soon: bool = False) -> None:
        """Start a refresh unless one is still running (with SOON: another right after it) or
        the view is hidden."""
        if self._waiting_since is not None:
            self._again = self._again or soon
            return
        if not self.is_current:
            return
        self._waiting_since = self.dctl.now()
        self.run_worker(self._refresh(), group="refresh", exit_on_error=False)

    async def _refresh(self) -> None:
        try:
            data = await self.fetch(self.dctl.client)
        except ClientError as exc:
            self.post_message(RefreshFailed(str(exc), unreachable=exc.status is None))
        except Exception as exc:  # any failure goes to the banner, never a traceback
            self.post_message(RefreshFailed(str(exc) or type(exc).__name__, unreachable=False))
        else:
            self.post_message(DataArrived(data))

    def on_data_arrived(self, message: DataArrived) -> None:
        """Show fresh data; the banner goes."""
        self._waiting_since = None
        self.dctl.link.succeeded(self.dctl.now())
        self.data = message.data
        try:
            self.show(message.data)
        except Exception as exc:  # a view that cannot draw says so; it never shows a traceback
            self.log.error(f"{self.TITLE}: cannot show the data", exc)
            self.notify(
                f"{self.TITLE}: cannot show the data: {exc}", severity="error", markup=False
            )
        self.update_banner()
        self._refresh_again()

    def on_refresh_failed(self, message: RefreshFailed) -> None:
        """Keep the data on screen and say in the banner how old it is."""
        self._waiting_since = None
        self.dctl.link.failed(message.error, message.unreachable)
        self.update_banner()
        self._refresh_again()

    def _refresh_again(self) -> None:
        if self._again:
            self._again = False
            self.refresh_data()

    def update_banner(self) -> None:
        """Re-render the banner (its age changes every second)."""
        app = self.dctl
        text = app.link.banner(app.now(), self._waiting_since, app.refresh_s)
        self.query_one(StaleBanner).show_text(text)

    # --- actions (the actions helper's `tui.actions`) -----------------------------------------

    def bind_actions(self, keys: list[tuple[str, str, str]]) -> None:
        """Bind KEYS (key, action, footer text) to `act(action)`, unless the app is read-only:
        then they are absent, not merely disabled."""
        if self.dctl.readonly:
            return
        for key, action, description in keys:
            self._bindings.bind(key, f"act('{action}')", description)

    def build_target(self) -> Any:
        """What an action applies to (a `tui.actions.Target`), None before data arrived."""
        return None

    def action_act(self, action: str) -> None:
        """Run ACTION on what the view shows, in a worker (its dialogs wait for answers)."""
        if self.dctl.readonly:
            return
        target = self.build_target()
        if target is not None:
            self.run_worker(self._act(action, target), group="action", exit_on_error=False)

    async def _act(self, action: str, target: Any) -> None:
        # Imported here: actions are a separate module, and the views work without them.
        from tui.actions.run import run_action

        try:
            accepted = await run_action(self.app, self.dctl.client, action, target)
        except Exception as exc:  # an action's failure is shown, never a traceback
            self.notify(f"{action}: {exc}", severity="error", markup=False)
            return
        if accepted:
            self.refresh_data(soon=True)

    # --- keys ------------------------------------------------------------------------------

    async def action_open_selected(self) -> None:
        """`enter`: drill into the selected row."""
        table = self.table
        if table is not None:
            await table.action_select_cursor()

    def action_filter(self) -> None:
        """`/`: type a filter for the table."""
        if self.HAS_FILTER:
            self.query_one(FilterBar).open()

    def on_input_changed(self, event: Input.Changed) -> None:
        """Narrow the table as the filter changes."""
        if isinstance(event.input, FilterBar) and self.table is not None:
            self.table.set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """`enter` in the filter keeps it and goes back to the table."""
        if isinstance(event.input, FilterBar) and self.table is not None:
            self.table.focus()

    def action_back(self) -> None:
        """`esc`: clear an open filter, else go back to the screen below."""
        if self.HAS_FILTER:
            bar = self.query_one(FilterBar)
            if bar.is_open:
                bar.close()
                if self.table is not None:
                    self.table.set_filter("")
                    self.table.focus()
                return
        if len(self.app.screen_stack) > 1:
            self.app.pop_screen()
