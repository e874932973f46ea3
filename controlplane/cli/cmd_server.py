"""`dctl server` and `dctl db`: run the control plane and manage its database schema."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available

db_app = typer.Typer(
    help="Manage the control-plane database schema (alembic).", no_args_is_help=True
)


def server() -> None:
    """Run the control plane (REST API, controllers, gateway)."""
    not_available("server")


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Upgrade the database to the latest schema."""
    not_available("db upgrade")


@db_app.command("downgrade")
def db_downgrade(revision: str) -> None:
    """Downgrade the database to REVISION."""
    not_available("db downgrade")


@db_app.command("current")
def db_current() -> None:
    """Show the database's schema revision."""
    not_available("db current")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.command("server")(server)
    app.add_typer(db_app, name="db")
