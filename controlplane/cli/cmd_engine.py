"""`dctl engine`: run and inspect the block-diffusion inference engine."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available

engine_app = typer.Typer(help="Run the block-diffusion inference engine.", no_args_is_help=True)


@engine_app.command("serve")
def serve() -> None:
    """Serve a checkpoint over the OpenAI-compatible HTTP API."""
    not_available("engine serve")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(engine_app, name="engine")
