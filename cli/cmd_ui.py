"""`dctl tui`: the terminal dashboard."""

from __future__ import annotations

import typer

from cli.exits import not_available


def tui() -> None:
    """The terminal dashboard."""
    not_available("tui")


def register(app: typer.Typer) -> None:
    """Attach this command to the root app."""
    app.command("tui")(tui)
