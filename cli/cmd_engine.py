"""`dctl engine`: run and inspect the block-diffusion inference engine."""

from __future__ import annotations

import typer

engine_app = typer.Typer(help="Run the block-diffusion inference engine.", no_args_is_help=True)


@engine_app.command(
    "serve",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def serve(ctx: typer.Context) -> None:
    """Serve a checkpoint over the OpenAI-compatible HTTP API.

    Usage: dctl engine serve --config engine.yaml [--port N --model DIR ...]; every key of the
    config file has a flag (see `dctl engine serve --help`). SIGTERM drains, then exits 0.
    `--parallel N [--experts expert|tensor]` serves one instance as N ranks (parallel.size,
    parallel.experts): one per GPU, or N CPU processes.
    """
    # The engine owns its argument parser, so `dctl engine serve` and `python -m engine.serve`
    # accept exactly the same flags and print the same errors.
    from engine.serve import main

    raise typer.Exit(main(list(ctx.args), prog="dctl engine serve"))


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(engine_app, name="engine")
