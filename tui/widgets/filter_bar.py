"""The `/` filter: an input under a table that narrows its rows as you type."""

from __future__ import annotations

from textual.widgets import Input


class FilterBar(Input):
    """Hidden until `/`; its value narrows the view's table (the view listens to `Changed`)."""

    DEFAULT_CSS = """
    FilterBar { display: none; dock: bottom; height: 1; border: none; padding: 0 1; }
    FilterBar.-open { display: block; }
    """

    def __init__(self) -> None:
        super().__init__(placeholder="filter (enter keeps it, esc clears)", id="filter")

    @property
    def is_open(self) -> bool:
        """Whether the filter is showing."""
        return self.has_class("-open")

    def open(self) -> None:
        """Show the filter and type into it."""
        self.add_class("-open")
        self.focus()

    def close(self) -> None:
        """Clear the filter and hide it."""
        self.value = ""
        self.remove_class("-open")
