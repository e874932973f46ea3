"""`dctl rollout`, `dctl rollback`, `dctl restart`: change what runs, safely."""

from __future__ import annotations

import typer

from cli.exits import not_available

rollout_app = typer.Typer(help="Canary rollouts of a new model version.", no_args_is_help=True)


@rollout_app.command("start")
def rollout_start(deployment: str) -> None:
    """Start a canary rollout of DEPLOYMENT."""
    not_available("rollout start")


@rollout_app.command("status")
def rollout_status(deployment: str) -> None:
    """Show the rollout of DEPLOYMENT."""
    not_available("rollout status")


def rollback(deployment: str) -> None:
    """Roll DEPLOYMENT back to an earlier weight snapshot."""
    not_available("rollback")


def restart(deployment: str) -> None:
    """Restart the engine instances of DEPLOYMENT."""
    not_available("restart")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(rollout_app, name="rollout")
    app.command("rollback")(rollback)
    app.command("restart")(restart)
