"""`dctl gateway`: the fleet's OpenAI-compatible front door (stable/canary pools by weight).

An adapter: flags -> `gateway.settings` (defaults < `[gateway]` table of the config file <
`DCTL_GATEWAY_*` env < these flags; a flag left out here is None and does not override) ->
`gateway.main.run`. The gateway is imported inside the command, so `dctl --help` stays light.
"""

from __future__ import annotations

from pathlib import Path

import typer

from cli.exits import USAGE, fail


def gateway(
    config: Path | None = typer.Option(
        None,
        "--config",
        help="Settings file whose [gateway] table to read (default: DCTL_CONFIG, else "
        "~/.config/dctl/config.toml).",
    ),
    control_plane: str | None = typer.Option(
        None, "--control-plane", help="Control-plane URL to read routes from and report to."
    ),
    token_file: Path | None = typer.Option(
        None,
        "--token-file",
        help="File (0600) holding a token of role gateway (or env DCTL_GATEWAY_TOKEN).",
    ),
    ca_file: Path | None = typer.Option(
        None, "--ca-file", help="CA bundle the control plane's certificate is verified with."
    ),
    routes_file: Path | None = typer.Option(
        None,
        "--routes-file",
        help="Serve a fixed routing table (JSON or YAML) instead of the control plane's.",
    ),
    host: str | None = typer.Option(None, "--host", help="Address to listen on [127.0.0.1]."),
    port: int | None = typer.Option(None, "--port", help="Port to listen on [8800]."),
    no_pool_header: bool = typer.Option(
        False,
        "--no-pool-header",
        help="Ignore the x-dctl-pool header, even from client tokens granted --allow-pool-pin.",
    ),
    head_timeout_s: float | None = typer.Option(
        None, "--head-timeout-s", help="Seconds for a request's line and headers, else 408 [10]."
    ),
    body_timeout_s: float | None = typer.Option(
        None, "--body-timeout-s", help="Seconds from the headers to the body's end, else 408 [30]."
    ),
    idle_timeout_s: float | None = typer.Option(
        None, "--idle-timeout-s", help="Seconds an idle kept-alive connection is kept [20]."
    ),
    max_concurrency_per_token: int | None = typer.Option(
        None,
        "--max-concurrency-per-token",
        help="Requests in flight per client token unless it has its own cap, else 429 [64].",
    ),
    max_connections: int | None = typer.Option(
        None, "--max-connections", help="Open client connections, past which 503 [4096]."
    ),
    request_log_file: Path | None = typer.Option(
        None,
        "--request-log-file",
        help="Write one JSON line per request here (rotated; default: none, the summaries "
        "still go to the control plane).",
    ),
    request_log_max_bytes: int | None = typer.Option(
        None, "--request-log-max-bytes", help="Rotate the request log past this [100 MiB]."
    ),
    request_log_max_files: int | None = typer.Option(
        None, "--request-log-max-files", help="Request log files kept, the current one too [5]."
    ),
    summary_sample_rps: float | None = typer.Option(
        None,
        "--summary-sample-rps",
        help="Request summaries per second reported to the control plane; past it a sample "
        "(errors always) [20].",
    ),
    tls_cert: Path | None = typer.Option(
        None, "--tls-cert", help="Serve HTTPS with this PEM certificate (chain included)."
    ),
    tls_key: Path | None = typer.Option(
        None, "--tls-key", help="The certificate's private key (PEM; not readable by others)."
    ),
) -> None:
    """Run the gateway: OpenAI API in front of every deployment, canary by weight, metrics."""
    from gateway.main import run
    from gateway.settings import SettingsError, load_gateway_settings

    try:
        settings = load_gateway_settings(
            config,
            control_plane=control_plane,
            token_file=token_file,
            ca_file=ca_file,
            routes_file=routes_file,
            host=host,
            port=port,
            pool_header=False if no_pool_header else None,
            head_timeout_s=head_timeout_s,
            body_timeout_s=body_timeout_s,
            idle_timeout_s=idle_timeout_s,
            max_concurrency_per_token=max_concurrency_per_token,
            max_connections=max_connections,
            request_log_file=request_log_file,
            request_log_max_bytes=request_log_max_bytes,
            request_log_max_files=request_log_max_files,
            summary_sample_rps=summary_sample_rps,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        code = run(settings)
    except SettingsError as exc:
        fail(str(exc), USAGE)
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    """Attach the command to the root app."""
    app.command("gateway")(gateway)
