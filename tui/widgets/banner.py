"""The stale-data banner: shown while the control plane is slow or unreachable."""

from __future__ import annotations

from textual.widgets import Static

from protocol.plain_text import printable


class StaleBanner(Static):
    """One line over the view saying how old its data is and why; hidden while all is well."""

    DEFAULT_CSS = """
    StaleBanner { display: none; }
    StaleBanner.-stale { display: block; }
    """

    def show_text(self, text: str | None) -> None:
        """Show TEXT, or hide the banner for None."""
        self.set_class(text is not None, "-stale")
        # The reason may quote a server's answer.
        self.update(printable(text or ""))
