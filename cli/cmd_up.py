"""`dctl up`: the whole stack (control plane, agent, engines, gateway) on this machine.

The demo lives in `cli.demo` (`cli.demo.run` is its entry module); this is its flags.
"""

from __future__ import annotations

from pathlib import Path

import typer

from cli.demo.traffic import DEFAULT_RPS
from cli.exits import USAGE, fail

MAX_TRAFFIC_RPS = 50.0  # the demo's engines share this machine's cores with everything else


def up(
    demo: bool = typer.Option(False, "--demo", help="Run the demo stack."),
    data_dir: Path = typer.Option(
        None, "--data-dir", help="Where the demo keeps everything (default: DATA_DIR/demo)."
    ),
    port: int = typer.Option(8700, "--port", min=1, max=65535, help="Control-plane port."),
    size: str | None = typer.Option(
        None,
        "--size",
        help="Serve a random-weight checkpoint of this size (tiny or small) instead of the "
        "trained demo model.",
    ),
    timeout_s: float = typer.Option(
        600.0, "--timeout-s", help="How long to wait for the engine to become ready."
    ),
    traffic_rps: float = typer.Option(
        DEFAULT_RPS,
        "--traffic-rps",
        help="Chat completions per second the demo sends through the gateway, so a rollout "
        "has requests to analyse; 0 turns it off.",
    ),
) -> None:
    """Start control plane, agent and engine on this machine (`--demo`: with the trained demo
    model)."""
    if not demo:
        fail("only the demo stack exists so far: run `dctl up --demo`", USAGE)
    if size is not None and size not in ("tiny", "small"):
        fail(f"--size {size!r}: choose tiny or small", USAGE)
    if not 0 <= traffic_rps <= MAX_TRAFFIC_RPS:
        fail(f"--traffic-rps {traffic_rps:g}: choose 0 (off) to {MAX_TRAFFIC_RPS:g}", USAGE)
    from cli.demo.run import DemoSettings, run
    from runtime import paths

    target = (data_dir or paths.data_dir() / "demo").expanduser().resolve()
    raise typer.Exit(run(DemoSettings(target, port, size, timeout_s, traffic_rps)))


def register(app: typer.Typer) -> None:
    """Attach this command to the root app."""
    app.command("up")(up)
