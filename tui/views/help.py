"""`?`: every key of the view it was opened over, and the views `:` reaches."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from tui.commands import VIEWS


class HelpScreen(ModalScreen[None]):
    """A table of KEYS (key, what it does) for the view TITLE; `esc`, `q` or `?` close it."""

    BINDINGS: ClassVar[list[Any]] = [
        Binding("escape,q,question_mark", "close", "Close", show=False),
    ]

    def __init__(self, title: str, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.view_title = title
        self.keys = keys

    def compose(self) -> ComposeResult:
        """The keys, then the views."""
        with VerticalScroll(id="help"):
            yield Static(f"keys: {self.view_title}", classes="section-title", markup=False)
            keys: DataTable[str] = DataTable(id="help-keys", show_cursor=False)
            yield keys
            yield Static("views (:name or ctrl+p)", classes="section-title")
            views: DataTable[str] = DataTable(id="help-views", show_cursor=False)
            yield views

    def on_mount(self) -> None:
        """Fill both tables."""
        keys = self.query_one("#help-keys", DataTable)
        keys.add_columns("key", "action")
        for key, description in self.keys:
            keys.add_row(key, description)
        views = self.query_one("#help-views", DataTable)
        views.add_columns("view", "shows")
        for name, text in VIEWS.items():
            views.add_row(f":{name}", text)

    def action_close(self) -> None:
        """Back to the view."""
        self.dismiss(None)
