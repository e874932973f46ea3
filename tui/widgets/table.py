"""A DataTable of resources: rows by key, a text filter, and `enter` that drills into a row."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widgets import DataTable

from tui.widgets.cells import plain

# How long `enter` on a table still waiting for its first data waits for rows to arrive.
FIRST_ROWS_WAIT_S = 5.0


@dataclass(frozen=True)
class Row:
    """One table row: its key (what drilling down opens) and its cells."""

    key: str
    cells: Sequence[str | Text]

    def matches(self, needle: str) -> bool:
        """Whether any cell contains NEEDLE (lower case)."""
        return any(needle in str(cell).lower() for cell in self.cells)


class ResourceTable(DataTable[str | Text]):
    """Rows replaced whole on each refresh, the cursor kept on the same key, `/` narrowing them.

    `enter` asks the screen to open the selected row (`open_row(table, key)`) and waits for it,
    so a key pressed right after lands on the screen it opened; pressed before the first data
    arrived, it waits for the rows first.
    """

    def __init__(self, columns: Sequence[str], *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self._column_names = list(columns)
        self._rows: list[Row] = []
        self._needle = ""
        self._filled = asyncio.Event()

    def on_mount(self) -> None:
        """Add the columns."""
        self.add_columns(*self._column_names)

    @property
    def keys(self) -> list[str]:
        """The keys of the rows shown, top to bottom."""
        return [str(key.value) for key in self.rows]

    def cell_text(self, key: str, column: int) -> str:
        """The plain text of row KEY's cell in COLUMN (for tests and the filter)."""
        return str(self.get_row(key)[column])

    def show_rows(self, rows: Sequence[Row]) -> None:
        """Replace the rows, keep the cursor on its key, apply the filter."""
        self._rows = list(rows)
        self._render_rows()
        self._filled.set()

    def set_filter(self, text: str) -> None:
        """Show only rows with a cell containing TEXT (any case); empty shows all."""
        self._needle = text.strip().lower()
        self._render_rows()

    def _render_rows(self) -> None:
        selected = self.selected_key
        self.clear()
        for row in self._rows:
            if not self._needle or row.matches(self._needle):
                # Cells hold what servers sent: as plain text, never markup or escapes.
                self.add_row(*map(plain, row.cells), key=row.key)
        if selected is not None and selected in self.keys:
            self.move_cursor(row=self.keys.index(selected), animate=False)

    @property
    def selected_key(self) -> str | None:
        """The key of the row under the cursor, None for an empty table."""
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)

    async def action_select_cursor(self) -> None:
        """Open the selected row on the screen (waiting for the first rows if none came yet)."""
        if not self._filled.is_set():
            try:
                await asyncio.wait_for(self._filled.wait(), FIRST_ROWS_WAIT_S)
            except TimeoutError:
                return
        key = self.selected_key
        opener = getattr(self.screen, "open_row", None)
        if key is not None and opener is not None:
            await opener(self, key)
