"""`:events`: the event log, newest first, following live; `/` filters it."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding

from client import AsyncControlPlaneClient
from protocol.rest import EventOut
from tui import fetch
from tui import format as fmt
from tui.fetch import EventsData
from tui.views.base import ViewScreen
from tui.widgets.table import ResourceTable, Row

COLUMNS = ["time", "kind", "subject", "actor", "message"]
FIRST_PAGE = 200
KEPT = 1000


class EventsScreen(ViewScreen):
    """Events, newest on top; each refresh asks only for those after the last one seen."""

    TITLE = "events"
    HAS_FILTER = True
    BINDINGS: ClassVar[list[Any]] = [Binding("slash", "filter", "Filter", key_display="/")]

    def __init__(self) -> None:
        super().__init__()
        self.events: list[EventOut] = []
        self._cursor: int | None = None

    def body(self) -> ComposeResult:
        """One table."""
        yield ResourceTable(COLUMNS, id="events")

    @property
    def table(self) -> ResourceTable:
        """The events table."""
        return self.query_one("#events", ResourceTable)

    async def fetch(self, client: AsyncControlPlaneClient) -> EventsData:
        """Events after the last one seen (the newest page the first time)."""
        return await fetch.events(client, self._cursor, FIRST_PAGE)

    def show(self, data: EventsData) -> None:
        """Put new events on top."""
        fresh = [e for e in data.events if self._cursor is None or e.id > self._cursor]
        self._cursor = max(self._cursor or 0, data.cursor)
        if not fresh and self.table.row_count:
            return
        self.events = fetch.newest_first(fresh, self.events, KEPT)
        self.table.show_rows(
            [
                Row(str(e.id), (fmt.clock_time(e.time), e.kind, e.subject, e.actor, e.message))
                for e in self.events
            ]
        )
