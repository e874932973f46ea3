"""`dctl rollout`, `dctl rollback`, `dctl restart`: change what runs, safely.

`dctl rollout DEPLOYMENT --to ...` starts a rollout and `dctl rollout status DEPLOYMENT` reads
one: the first argument is a subcommand when it names one, else the deployment of the hidden
`start` command. The server refuses deployments named like a subcommand, so that is never
ambiguous; `start` itself may name a deployment, hence `dctl rollout start start --to ...`.
Every wait polls the record once a second until its state is final.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from cli.options import duration_option, engine_config_option, percent_option, percents_option
from cli.output import JSON_OPTION, print_json, print_table
from cli.remote import connect, validated
from cli.rollout_view import (
    HISTORY_COLUMNS,
    exit_code,
    history_row,
    is_final,
    progress_lines,
    started_text,
    status_text,
    summary_line,
)

if TYPE_CHECKING:
    # typer ships its own copy of click; a group subclass must speak that copy's types.
    from typer._click import Command, Context

    from client.calls import RolloutVerb
    from client.http import ControlPlaneClient
    from protocol.rollouts import RolloutCreate, RolloutOut

START = "start"
POLL_S = 1.0
CLEAR_SCREEN = "\x1b[H\x1b[2J"

Show = Callable[["RolloutOut | None", "RolloutOut"], None]


class DeploymentOrCommandGroup(TyperGroup):
    """A group whose first argument is a subcommand or else the DEPLOYMENT of `start`."""

    def resolve_command(
        self, ctx: Context, args: list[str]
    ) -> tuple[str | None, Command | None, list[str]]:
        """The named subcommand, or `start` with every argument (the deployment first)."""
        # No deployment may be named like a subcommand (`ROLLOUT_SUBCOMMANDS`, refused at
        # `deploy create`), so the first argument decides.
        name = args[0] if args else ""
        if name in self.commands:
            return super().resolve_command(ctx, args)
        return START, self.commands[START], args


rollout_app = typer.Typer(
    cls=DeploymentOrCommandGroup,
    no_args_is_help=True,
    subcommand_metavar="DEPLOYMENT [OPTIONS] | COMMAND [ARGS]...",
    help=(
        "Canary rollouts of a new model version or engine config.\n\n"
        "Start one: dctl rollout DEPLOYMENT --to [MODEL:]VERSION [--engine-config FILE] "
        "[--canary 10%] [--steps 10,25,50,100] [--interval 5m] [--wait]; "
        "`dctl rollout DEPLOYMENT --help` lists every option. "
        "The commands below follow and steer the rollout it starts."
    ),
)


def _rollout_spec(
    to: str | None,
    engine_config: Path | None,
    canary: str,
    steps: str | None,
    interval: str | None,
    thresholds: dict[str, Any],
    surge: int,
    reason: str,
) -> RolloutCreate:
    """The body of `POST .../rollout`; any bad input is a usage error before a request is made."""
    from protocol.rollout_policy import RolloutPolicy
    from protocol.rollouts import RolloutCreate

    # Only the form of each flag is checked here; `RolloutCreate` holds the rules (the canary's
    # range, rising steps, something to roll out) and names the field it refuses.
    first = percent_option(canary, "--canary")
    plan = percents_option(steps, "--steps") if steps is not None else None
    interval_s = duration_option(interval, "--interval") if interval is not None else None
    config = engine_config_option(engine_config) if engine_config is not None else None
    return validated(
        lambda: RolloutCreate(
            to=to,
            engine_config=config,
            canary=first,
            steps=plan,
            surge=surge,
            policy=RolloutPolicy(interval_s=interval_s, **thresholds),
            reason=reason,
        )
    )


@rollout_app.command(START, hidden=True)
def rollout_start(
    deployment: str = typer.Argument(..., help="The deployment to roll out."),
    to: str | None = typer.Option(None, "--to", metavar="[MODEL:]VERSION", help="The new version."),
    engine_config: Path | None = typer.Option(
        None, "--engine-config", help="YAML or JSON file: the new engine config (whole)."
    ),
    canary: str = typer.Option("10%", "--canary", help="First step's share of requests, 1-99%."),
    steps: str | None = typer.Option(
        None, "--steps", metavar="W,W,...,100", help="Every step's weight (overrides --canary)."
    ),
    interval: str | None = typer.Option(
        None, "--interval", help="How long each step is held and analysed: 30s, 5m, 1h."
    ),
    max_error_rate_increase: float | None = typer.Option(
        None, "--max-error-rate-increase", help="Canary error rate minus stable's, e.g. 0.01."
    ),
    max_latency_ratio: float | None = typer.Option(
        None, "--max-latency-ratio", help="Canary p95 latency / stable's."
    ),
    max_ttft_ratio: float | None = typer.Option(
        None, "--max-ttft-ratio", help="Canary p95 time to first token / stable's."
    ),
    max_steps_per_block_ratio: float | None = typer.Option(
        None, "--max-steps-per-block-ratio", help="Canary denoising steps per block / stable's."
    ),
    min_tokens_per_forward_ratio: float | None = typer.Option(
        None, "--min-tokens-per-forward-ratio", help="Canary tokens per forward / stable's."
    ),
    min_requests: int | None = typer.Option(
        None, "--min-requests", help="Requests per pool an analysis needs, else inconclusive."
    ),
    failure_limit: int | None = typer.Option(
        None, "--failure-limit", help="Failing analyses in a row that abort the rollout."
    ),
    surge: int = typer.Option(
        0, "--surge", min=0, help="Canary instances beside stable's where GPUs are free."
    ),
    notify: str | None = typer.Option(
        None, "--notify", metavar="URL", help="Gets a JSON POST on every change of state."
    ),
    reason: str = typer.Option("", "--reason", help="Why, for the history."),
    wait: bool = typer.Option(
        False, "--wait", help="Follow it until it ends; exit 1 unless promoted."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Start a canary rollout of DEPLOYMENT to --to and/or --engine-config (operator).

    Thresholds not given come from the deployment's rollout policy, else the defaults.
    """
    thresholds = {
        "max_error_rate_increase": max_error_rate_increase,
        "max_latency_ratio": max_latency_ratio,
        "max_ttft_ratio": max_ttft_ratio,
        "max_steps_per_block_ratio": max_steps_per_block_ratio,
        "min_tokens_per_forward_ratio": min_tokens_per_forward_ratio,
        "min_requests": min_requests,
        "failure_limit": failure_limit,
        "notify": notify,
    }
    spec = _rollout_spec(to, engine_config, canary, steps, interval, thresholds, surge, reason)
    with connect() as api:
        created = api.start_rollout(deployment, spec)
        if not as_json:
            sys.stdout.write(started_text(created))
        if wait:
            _finish(api, created, _quiet if as_json else _redraw(as_json=False), as_json)
    if as_json:
        print_json(created.as_json())


@rollout_app.command("status")
def rollout_status(
    deployment: str,
    watch: bool = typer.Option(
        False,
        "--watch",
        "-w",
        help="Redraw every second until it ends; exit 1 unless it succeeded.",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Show the active (else the latest) rollout, rollback or restart of DEPLOYMENT."""
    with connect() as api:
        current = api.get_rollout(deployment)
        if watch:
            _finish(api, current, _redraw(as_json), as_json=False)
    if as_json:
        print_json(current.as_json())
    else:
        sys.stdout.write(status_text(current))


def _act(deployment: str, action: RolloutVerb, **body: Any) -> None:
    from protocol.rollouts import RolloutAction

    spec = validated(lambda: RolloutAction(**body))
    with connect() as api:
        changed = api.rollout_action(deployment, action, spec)
    print(summary_line(changed))


REASON_OPTION = typer.Option("", "--reason", help="Why, for the history.")


@rollout_app.command("promote")
def rollout_promote(
    deployment: str,
    full: bool = typer.Option(False, "--full", help="Skip the remaining steps: 100% now."),
    reason: str = REASON_OPTION,
) -> None:
    """Move DEPLOYMENT's rollout to its next step now, or with --full finish it (operator)."""
    _act(deployment, "promote", full=full, reason=reason)


@rollout_app.command("abort")
def rollout_abort(deployment: str, reason: str = REASON_OPTION) -> None:
    """Stop DEPLOYMENT's rollout and send every request to the stable version (operator)."""
    _act(deployment, "abort", reason=reason)


@rollout_app.command("pause")
def rollout_pause(deployment: str) -> None:
    """Hold DEPLOYMENT's rollout at its step: no analysis, no promotion (operator)."""
    _act(deployment, "pause")


@rollout_app.command("resume")
def rollout_resume(deployment: str) -> None:
    """Let DEPLOYMENT's paused rollout go on (operator)."""
    _act(deployment, "resume")


@rollout_app.command("history")
def rollout_history(
    deployment: str,
    limit: int | None = typer.Option(None, "--limit", min=1, help="At most this many."),
    as_json: bool = JSON_OPTION,
) -> None:
    """DEPLOYMENT's rollouts, rollbacks and restarts, newest first."""
    with connect() as api:
        records = api.rollout_history(deployment, limit)
    if as_json:
        print_json([r.as_json() for r in records])
    else:
        print_table([history_row(r) for r in records], HISTORY_COLUMNS, empty="no rollouts")


NO_WAIT_OPTION = typer.Option(
    False, "--no-wait", help="Return once it has started, printing its id."
)


def rollback(
    deployment: str,
    to: str | None = typer.Option(
        None, "--to", metavar="[MODEL:]VERSION", help="Default: the version before this one."
    ),
    all_at_once: bool = typer.Option(
        False, "--all-at-once", help="Replace every instance at once, not one at a time."
    ),
    no_wait: bool = NO_WAIT_OPTION,
    reason: str = REASON_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Move DEPLOYMENT back to an earlier version its hosts still hold (operator)."""
    from protocol.rollouts import RollbackCreate

    spec = validated(lambda: RollbackCreate(to=to, all_at_once=all_at_once, reason=reason))
    with connect() as api:
        _started(api, api.rollback(deployment, spec), no_wait, as_json, rollback=True)


def restart(
    deployment: str,
    host: str | None = typer.Option(None, "--host", help="Only the instances on this host."),
    instance: int | None = typer.Option(None, "--instance", metavar="ID", help="Only this one."),
    no_wait: bool = NO_WAIT_OPTION,
    reason: str = REASON_OPTION,
    as_json: bool = JSON_OPTION,
) -> None:
    """Restart DEPLOYMENT's engine instances one at a time (operator)."""
    from protocol.rollouts import RestartCreate

    spec = validated(lambda: RestartCreate(host=host, instance=instance, reason=reason))
    with connect() as api:
        _started(api, api.restart(deployment, spec), no_wait, as_json)


def _started(
    api: ControlPlaneClient,
    created: RolloutOut,
    no_wait: bool,
    as_json: bool,
    rollback: bool = False,
) -> None:
    if no_wait:
        if as_json:
            print_json(created.as_json())
        else:
            sys.stdout.write(started_text(created))
        return
    _finish(api, created, _quiet if as_json else _progress, as_json, rollback=rollback)


def follow(
    first: RolloutOut,
    fetch: Callable[[], RolloutOut],
    show: Show,
    *,
    interval: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RolloutOut:
    """Show FIRST, then what FETCH answers every INTERVAL seconds, until the state is final."""
    period = POLL_S if interval is None else interval
    before, now = None, first
    due = clock()
    while True:
        show(before, now)
        if is_final(now):
            return now
        # Ticks keep to a fixed period from the start however long each request takes.
        due += period
        sleep(max(0.0, due - clock()))
        before, now = now, fetch()


def _finish(
    api: ControlPlaneClient, first: RolloutOut, show: Show, as_json: bool, rollback: bool = False
) -> None:
    """Follow FIRST to its end (Ctrl-C: typer exits 130), print it as JSON if asked, and exit
    with the code its final state means (for `dctl rollback`, a rollout it ended counts)."""
    final = follow(first, lambda: api.rollout_by_id(first.deployment, first.id), show)
    if as_json:
        print_json(final.as_json())
    raise typer.Exit(exit_code(final, rollback=rollback))


def _change(rollout: RolloutOut) -> dict[str, Any]:
    # The countdown moves every second; only other fields count as a change worth a new block.
    return rollout.model_dump(mode="json", exclude={"time_left_s", "updated_at"})


def _redraw(as_json: bool) -> Show:
    """`--watch`: a terminal is redrawn every tick; a pipe gets a block (or, with --json, a JSON
    line) each time something changed."""
    tty = sys.stdout.isatty() and not as_json

    def show(before: RolloutOut | None, now: RolloutOut) -> None:
        if tty:
            sys.stdout.write(CLEAR_SCREEN + status_text(now))
        elif before is None or _change(before) != _change(now):
            if as_json:
                sys.stdout.write(json.dumps(now.as_json(), default=str) + "\n")
            else:
                sys.stdout.write(("\n" if before is not None else "") + status_text(now))
        sys.stdout.flush()

    return show


def _progress(before: RolloutOut | None, now: RolloutOut) -> None:
    """Rollback and restart waits: a line per change."""
    sys.stdout.writelines(line + "\n" for line in progress_lines(before, now))
    sys.stdout.flush()


def _quiet(before: RolloutOut | None, now: RolloutOut) -> None:
    """Waits with --json: nothing until the final record."""


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(rollout_app, name="rollout")
    app.command("rollback")(rollback)
    app.command("restart")(restart)
