"""`dctl model`: register, list and inspect model versions (immutable weight snapshots)."""

from __future__ import annotations

import typer

from controlplane.cli.exits import fail, not_available

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


@model_app.command("create-demo")
def model_create_demo(
    directory: str = typer.Argument(..., help="New (or empty) directory to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random weights."),
    size: str = typer.Option("tiny", "--size", help="tiny (tests) or small (README demo)."),
) -> None:
    """Write a deterministic demo checkpoint (random weights, real tokenizer) into DIRECTORY."""
    from engine.demo_checkpoint import create_demo_checkpoint

    try:
        path = create_demo_checkpoint(directory, seed=seed, size=size)
    except ValueError as exc:
        fail(str(exc))
    print(f"demo checkpoint ({size}, seed {seed}) written to {path}")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(model_app, name="model")
