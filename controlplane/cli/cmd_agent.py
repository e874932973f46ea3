"""`dctl agent`: the per-host agent and its preflight checks."""

from __future__ import annotations

import typer

from controlplane.cli.exits import not_available

agent_app = typer.Typer(help="Run the per-host agent (preflight, snapshots, engine supervision).")


@agent_app.callback(invoke_without_command=True)
def agent(ctx: typer.Context) -> None:
    """Run the agent: register with the control plane, heartbeat, supervise engines."""
    if ctx.invoked_subcommand is None:
        not_available("agent")


@agent_app.command("preflight")
def preflight() -> None:
    """Check drivers, GPUs, disk and torch on this host."""
    not_available("agent preflight")


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(agent_app, name="agent")
