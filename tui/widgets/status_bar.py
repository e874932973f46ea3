"""The line above the key footer: context, view, refresh period, and whether actions are off."""

from __future__ import annotations

from textual.widgets import Static


class StatusBar(Static):
    """`ctx local · deployments · every 2s · read-only`."""

    def show(self, context: str, view: str, refresh_s: float, readonly: bool) -> None:
        """Render the line for these settings."""
        parts = [f"ctx {context or '-'}", view, f"every {refresh_s:g}s"]
        if readonly:
            parts.append("read-only")
        self.update(" · ".join(parts))
