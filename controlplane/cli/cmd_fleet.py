"""`dctl status|events|host|token`: the fleet as the control plane sees."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available

host_app = typer.Typer(help="Hosts: list, drain, remove, provision.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens with roles.", no_args_is_help=True)


def status() -> None:
    """Fleet summary: hosts, deployments, instances."""
    not_available("status")


def events() -> None:
    """The audit log of the fleet."""
    not_available("events")


@host_app.command("list")
def host_list() -> None:
    """List hosts."""
    not_available("host list")


@token_app.command("create")
def token_create(name: str) -> None:
    """Create token NAME (the secret is shown once)."""
    not_available("token create")


@token_app.command("list")
def token_list() -> None:
    """List tokens (never their secrets)."""
    not_available("token list")


@token_app.command("revoke")
def token_revoke(name: str) -> None:
    """Revoke token NAME."""
    not_available("token revoke")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.command("status")(status)
    app.command("events")(events)
    app.add_typer(host_app, name="host")
    app.add_typer(token_app, name="token")
