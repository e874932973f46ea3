"""The `dctl` command line: the composition root that wires the four parts together.

Only this package may import `engine`, `agent` and `tui`, and only inside commands, so that
`dctl --help` stays fast (no torch, textual, fabric or sqlalchemy at import time).
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version

import typer

from cli import (
    cmd_agent,
    cmd_audit,
    cmd_autoscale,
    cmd_deploy,
    cmd_doctor,
    cmd_engine,
    cmd_fleet,
    cmd_gateway,
    cmd_logs,
    cmd_metrics,
    cmd_model,
    cmd_provision,
    cmd_requests,
    cmd_rollout,
    cmd_server,
    cmd_tune,
    cmd_ui,
    cmd_up,
)
from cli.exits import CliError

app = typer.Typer(
    name="dctl",
    help="dctl: run fleets of GPU hosts that serve MoE block-diffusion language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version() -> str:
    try:
        return version("dctl")
    except PackageNotFoundError:
        return "0+unknown"


def _show_version(value: bool) -> None:
    if value:
        print(f"dctl {_version()}")
        raise typer.Exit()


@app.callback()
def root(
    show_version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """dctl: run fleets of GPU hosts that serve MoE block-diffusion language models."""


for module in (cmd_server, cmd_gateway, cmd_engine, cmd_agent, cmd_model, cmd_deploy, cmd_rollout):
    module.register(app)
cmd_provision.register(cmd_fleet.host_app)
cmd_autoscale.register(cmd_deploy.deploy_app)
cmd_fleet.register(app)
cmd_metrics.register(app)
cmd_logs.register(app)
cmd_requests.register(app)
cmd_audit.register(app)
cmd_doctor.register(app)
cmd_up.register(app)
cmd_tune.register(app)
cmd_ui.register(app)


def main() -> None:
    """Console-script entry point: maps `CliError` to its exit code with one line on stderr."""
    try:
        app()
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.code)
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a crash: no traceback, the shell's usual code.
        print("interrupted", file=sys.stderr)
        sys.exit(130)
