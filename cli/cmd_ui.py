"""`dctl tui`: the terminal dashboard."""

from __future__ import annotations

import typer

from cli.exits import USAGE, fail


def tui(
    context: str | None = typer.Option(
        None, "--context", help="Credentials context to use (default: the current one)."
    ),
    readonly: bool = typer.Option(
        False, "--readonly", help="Watch only: no rollout, rollback, restart or drain keys."
    ),
    refresh: str = typer.Option("2s", "--refresh", help="How often views refresh: 2s, 10s, 1m."),
) -> None:
    """The terminal dashboard: hosts, GPUs, deployments, rollouts and events, live."""
    # Imported here so `dctl --help` never pays for textual or httpx.
    from cli.options import duration_option
    from client.credentials import CredentialsError, resolve
    from client.errors import ClientError
    from client.http import AsyncControlPlaneClient
    from runtime.settings import SettingsError

    refresh_s = duration_option(refresh, "--refresh")
    try:
        ctx = resolve(context)
    except CredentialsError as exc:
        # A --context that names nothing is a bad argument; a missing setup is a failure.
        fail(str(exc), USAGE if context else 1)
    try:
        from tui.settings import TuiSettings

        thresholds = TuiSettings.load().thresholds()
        client = AsyncControlPlaneClient.from_context(ctx)
    except (ClientError, SettingsError) as exc:
        fail(str(exc))

    from tui.app import DctlApp

    DctlApp(
        client, context_name=ctx.name, readonly=readonly, refresh_s=refresh_s, thresholds=thresholds
    ).run()


def register(app: typer.Typer) -> None:
    """Attach this command to the root app."""
    app.command("tui")(tui)
