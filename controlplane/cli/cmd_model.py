"""`dctl model`: register, list and inspect model versions (immutable weight snapshots)."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available

model_app = typer.Typer(
    help="Model versions: weight snapshots with sha256 manifests.", no_args_is_help=True
)


@model_app.command("list")
def model_list() -> None:
    """List models and their versions."""
    not_available("model list")


@model_app.command("register")
def model_register(name_version: str, directory: str) -> None:
    """Register NAME:VERSION from a checkpoint DIRECTORY (computes the manifest)."""
    not_available("model register")


@model_app.command("show")
def model_show(name_version: str) -> None:
    """Show one model version."""
    not_available("model show")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(model_app, name="model")
