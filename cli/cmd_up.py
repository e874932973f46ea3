"""`dctl up`: the whole stack (control plane, agent, engine) on this machine.

`cli.demo_stack` starts and stops the processes; this module is the command around it: its
options, what it prints once the demo is up, and Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from cli.demo_traffic import DEFAULT_RPS
from cli.exits import USAGE, CliError, fail

if TYPE_CHECKING:
    from cli.demo_stack import DemoEndpoints

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
    from protocol import paths

    target = (data_dir or paths.data_dir() / "demo").expanduser().resolve()
    raise typer.Exit(run_demo(target, port, size, timeout_s, traffic_rps))


def run_demo(
    data_dir: Path, port: int, size: str | None, timeout_s: float, traffic_rps: float = DEFAULT_RPS
) -> int:
    """The `dctl up --demo` command: start, print what to do next, wait for Ctrl-C, stop."""
    from cli.demo_stack import DemoStack

    stop = threading.Event()
    started = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if not started.is_set():
            raise KeyboardInterrupt  # abandon start-up wherever it is; `finally` cleans up
        stop.set()

    def say(line: str) -> None:
        print(line, flush=True)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = DemoStack(data_dir, port, size, timeout_s, say=say, traffic_rps=traffic_rps)
    try:
        endpoints = stack.start()
        started.set()
        say(demo_summary(endpoints, size, traffic_rps))
        stack.watch(stop)
        say("stopping the demo...")
        return 0
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.code
    except KeyboardInterrupt:
        say("interrupted during start-up; stopping what was started")
        return 130
    finally:
        stack.stop()


def demo_summary(endpoints: DemoEndpoints, size: str | None, traffic_rps: float) -> str:
    """What `dctl up --demo` prints once the demo is up: endpoints and what to try."""
    from cli.demo_stack import (
        CANARY_INSTANCES,
        DEPLOYMENT,
        ROLLOUT_INTERVAL_S,
        ROLLOUT_MIN_REQUESTS,
    )

    lines = [
        "",
        "dctl demo is up.",
        f"Control plane: {endpoints.control_plane}",
        f"OpenAI base URL: {endpoints.base_url}",
        f"OpenAI API key: {endpoints.api_key}",
        f"Engine, bypassing the gateway: {endpoints.engine_url} (API key {endpoints.engine_key})",
    ]
    if endpoints.context:
        note = f"Credentials: context {endpoints.context!r} in the credentials file"
        if not endpoints.context_is_current:
            note += f" (`dctl context use {endpoints.context}` makes it current)"
        lines.append(note)
    can_canary = endpoints.instances >= CANARY_INSTANCES
    if can_canary:
        lines.append(
            f"Deployment {DEPLOYMENT!r}: {endpoints.instances} instances, one GPU each; its "
            f"rollout policy holds each step {ROLLOUT_INTERVAL_S:g} s and wants at least "
            f"{ROLLOUT_MIN_REQUESTS} requests per pool"
        )
    else:
        lines.append(
            f"Deployment {DEPLOYMENT!r}: one instance (one GPU here): no room for a canary"
        )
    if traffic_rps > 0:
        lines.append(
            f"Demo traffic: {traffic_rps:g} requests/s through the gateway "
            "(--traffic-rps 0 turns it off)"
        )
    else:
        lines.append("Demo traffic: off (a rollout is analysed only on the requests it gets)")
    sample = (
        f"curl {endpoints.base_url}/chat/completions -H 'Content-Type: application/json' "
        f"-H 'Authorization: Bearer {endpoints.api_key}' "
        f"""-d '{{"model": "{DEPLOYMENT}", "messages": [{{"role": "user", "content": """
        """"Hello!"}], "max_tokens": 32}'"""
    )
    lines += ["Try:", f"  {sample}", *(rollout_lines(size) if can_canary else [])]
    lines += [
        "  dctl status",
        "  dctl tui",
        f"  dctl doctor {DEPLOYMENT}",
        "  dctl metrics targets -o targets.json --watch   # for Prometheus",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)


def rollout_lines(size: str | None) -> list[str]:
    """The `Try:` lines that make `demo:v2` (a checkpoint of its own digest) and roll it out."""
    from cli.demo_stack import DEPLOYMENT, MODEL, ROLLOUT_INTERVAL_S

    # On the trained model --seed changes only generation_config.json: same weights, own digest.
    # A random checkpoint has no trained weights to keep (--seed picks other random ones).
    create = "dctl model create-demo ./demo-v2"
    if size is not None:
        create += f" --random --size {size}"
    create += " --seed 2"
    minutes = 3 * ROLLOUT_INTERVAL_S / 60  # steps 10, 50 and the promotion to 100
    return [
        f"  {create} && dctl model register {MODEL}:v2 ./demo-v2",
        f"  dctl rollout {DEPLOYMENT} --to {MODEL}:v2 --canary 10% --wait"
        f"      # ~{minutes:g} min: 10% -> 50% -> 100%",
        f"  dctl rollout status {DEPLOYMENT} --watch",
        f"  dctl rollback {DEPLOYMENT}",
    ]


def register(app: typer.Typer) -> None:
    """Attach this command to the root app."""
    app.command("up")(up)
