"""`dctl up` and `dctl tui`: the whole stack on one machine, and the dashboard."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available


def up(demo: bool = typer.Option(False, "--demo", help="Run the demo stack.")) -> None:
    """Start control plane, agent and engine on this machine."""
    not_available("up")


def tui() -> None:
    """The terminal dashboard."""
    not_available("tui")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.command("up")(up)
    app.command("tui")(tui)
