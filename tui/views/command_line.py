"""The `:` command line: type a view name (tab completes it), `enter` goes there."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Input, Static

from tui.commands import QUIT_WORDS, VIEWS, complete, resolve


class CommandLine(ModalScreen[str | None]):
    """Answers the view named (or `quit`), None when cancelled or unknown."""

    BINDINGS: ClassVar[list[Any]] = [
        Binding("tab", "complete", "Complete", priority=True, show=False),
        Binding("escape", "cancel", "Cancel", show=False),
    ]

    def compose(self) -> ComposeResult:
        """A prompt at the bottom of the screen, with the names it knows."""
        yield Static(" ".join(VIEWS), id="command-help", markup=False)
        yield Input(
            placeholder="view name (tab completes)",
            id="command",
            suggester=SuggestFromList(list(VIEWS), case_sensitive=False),
        )

    def on_mount(self) -> None:
        """Type straight away."""
        self.query_one(Input).focus()

    def action_complete(self) -> None:
        """Complete the name typed so far."""
        field = self.query_one(Input)
        field.value = complete(field.value)
        field.cursor_position = len(field.value)

    def action_cancel(self) -> None:
        """Close without going anywhere."""
        self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Go to the view named, or say which names exist."""
        word = event.value.strip().lower()
        if word in QUIT_WORDS:
            self.dismiss("quit")
            return
        view = resolve(word)
        if view is None:
            self.notify(f"no view {word!r}: try {', '.join(VIEWS)}", severity="warning")
            return
        self.dismiss(view)
