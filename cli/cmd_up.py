"""`dctl up`: the whole stack (control plane, agent, engine) on this machine."""

from __future__ import annotations

from pathlib import Path

import typer

from cli.exits import USAGE, fail


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
) -> None:
    """Start control plane, agent and engine on this machine (`--demo`: with the trained demo
    model)."""
    if not demo:
        fail("only the demo stack exists so far: run `dctl up --demo`", USAGE)
    if size is not None and size not in ("tiny", "small"):
        fail(f"--size {size!r}: choose tiny or small", USAGE)
    from cli.demo_stack import run_demo
    from protocol import paths

    target = (data_dir or paths.data_dir() / "demo").expanduser().resolve()
    raise typer.Exit(run_demo(target, port, size, timeout_s))


def register(app: typer.Typer) -> None:
    """Attach this command to the root app."""
    app.command("up")(up)
