"""`dctl deploy`: deployments of a model version onto hosts."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available

deploy_app = typer.Typer(help="Deployments: a model version placed on hosts.", no_args_is_help=True)


@deploy_app.command("create")
def deploy_create(name: str) -> None:
    """Create deployment NAME."""
    not_available("deploy create")


@deploy_app.command("list")
def deploy_list() -> None:
    """List deployments."""
    not_available("deploy list")


@deploy_app.command("show")
def deploy_show(name: str) -> None:
    """Show deployment NAME with its instances."""
    not_available("deploy show")


@deploy_app.command("scale")
def deploy_scale(name: str, instances_per_host: int) -> None:
    """Set the number of instances per host of deployment NAME."""
    not_available("deploy scale")


@deploy_app.command("delete")
def deploy_delete(name: str) -> None:
    """Delete deployment NAME."""
    not_available("deploy delete")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(deploy_app, name="deploy")
