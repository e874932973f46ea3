"""`dctl deploy autoscale`: the flags of an autoscaling policy, read into `AutoscalePolicy`.

Options left out keep the deployment's current policy (or the defaults when it has none), so
`--max 12` alone raises only the ceiling. The flags are checked on their own before any request
and the whole policy before it is sent; either way a refusal is a usage error naming the flag.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import USAGE, fail
from cli.options import duration_option
from cli.output import JSON_OPTION, plain, print_json
from cli.remote import connect, describe
from protocol.plain_text import printable

if TYPE_CHECKING:
    from pydantic import ValidationError

# Each field of `AutoscalePolicy` and the flag that sets it, for errors that name the flag.
AUTOSCALE_FLAGS = {
    "min": "--min",
    "max": "--max",
    "target_queue": "--target-queue",
    "target_utilization": "--target-utilization",
    "up_after_s": "--up-after",
    "down_after_s": "--down-after",
    "cooldown_s": "--cooldown",
    "standby": "--standby",
    "cold_start_timeout_s": "--cold-start-timeout",
}
_BOUND_WORDS = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "above"),
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "below"),
}


def _autoscale_refused(exc: ValidationError, shown: Mapping[str, str], origin: str) -> str:
    """A usage error's text for a policy the model refused: the flag, what was typed, the rule.

    SHOWN holds what was typed per field; ORIGIN says where the others came from."""
    from runtime.durations import format_duration

    err = exc.errors()[0]
    if not err["loc"]:
        # The one rule over two fields (min <= max): say where the one not typed came from.
        message = f"--min/--max: {describe(exc)}"
        left_out = next((f for f in ("min", "max") if f not in shown), None)
        if left_out is None:
            return message
        value = err["input"][left_out]
        return f"{message}; {left_out} {value} is {origin}: give --{left_out} too"
    field = str(err["loc"][0])
    flag, typed = AUTOSCALE_FLAGS.get(field, field), shown.get(field, str(err["input"]))
    bound = _BOUND_WORDS.get(err["type"])
    if bound is None:
        return f"{flag} {typed}: {str(err['msg']).removeprefix('Value error, ')}"
    limit = (err.get("ctx") or {})[bound[0]]
    limit_text = format_duration(limit) if field.endswith("_s") else f"{limit:g}"
    return f"{flag} {typed}: must be {bound[1]} {limit_text}"


def deploy_autoscale(
    name: str,
    min_: int | None = typer.Option(
        None, "--min", help="Fewest serving instances; 0 stops the last one when idle."
    ),
    max_: int | None = typer.Option(None, "--max", help="Most serving instances."),
    target_queue: float | None = typer.Option(
        None,
        "--target-queue",
        help="Requests waiting per serving instance above which it adds one.",
    ),
    target_utilization: float | None = typer.Option(
        None,
        "--target-utilization",
        help="Busy share of the instances' capacity (0..1) below which it removes one.",
    ),
    up_after: str | None = typer.Option(
        None,
        "--up-after",
        metavar="DURATION",
        help="The queue stays over target this long, e.g. 30s.",
    ),
    down_after: str | None = typer.Option(
        None, "--down-after", metavar="DURATION", help="Utilisation stays under target this long."
    ),
    cooldown: str | None = typer.Option(
        None, "--cooldown", metavar="DURATION", help="No other change this long after one."
    ),
    standby: int | None = typer.Option(
        None, "--standby", help="Loaded instances kept out of the pools, promoted on a scale-up."
    ),
    cold_start_timeout: str | None = typer.Option(
        None,
        "--cold-start-timeout",
        metavar="DURATION",
        help="With --min 0: how long the gateway holds a request while an instance starts.",
    ),
    off: bool = typer.Option(
        False, "--off", help="Stop autoscaling; it keeps the serving instances it has now."
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Scale deployment NAME on load between --min and --max serving instances (operator).

    Options left out keep the deployment's current policy, or the defaults when it has none;
    with no option, an autoscaled deployment is only shown.
    """
    from datetime import UTC, datetime

    from pydantic import ValidationError

    from cli.autoscale_view import serving_count, summary
    from client import calls
    from protocol.autoscale import MAX_REPLICAS, AutoscalePolicy

    numbers = {"min": min_, "max": max_, "target_queue": target_queue,
               "target_utilization": target_utilization, "standby": standby}  # fmt: skip
    durations = {"up_after_s": up_after, "down_after_s": down_after, "cooldown_s": cooldown,
                 "cold_start_timeout_s": cold_start_timeout}  # fmt: skip
    shown = {
        f: f"{v:g}" if isinstance(v, float) else str(v)
        for f, v in {**numbers, **durations}.items()
        if v is not None
    }
    if off:
        if shown:
            named = ", ".join(AUTOSCALE_FLAGS[f] for f in AUTOSCALE_FLAGS if f in shown)
            fail(f"--off turns autoscaling off: leave out {named}", USAGE)
        with connect() as api:
            cleared = api.send(calls.clear_autoscale(name))
        if as_json:
            print_json(plain(cleared))
            return
        serving = serving_count(cleared.instances)
        print(f"deployment {name}: autoscaling off; it keeps its {serving} serving instance(s)")
        return
    given: dict[str, Any] = {f: v for f, v in numbers.items() if v is not None}
    given |= {
        f: duration_option(v, AUTOSCALE_FLAGS[f]) for f, v in durations.items() if v is not None
    }
    try:
        # The flags on their own, before any request: bounds that leave min <= max to the flags.
        AutoscalePolicy.model_validate({"min": 0, "max": MAX_REPLICAS} | given)
    except ValidationError as exc:
        fail(_autoscale_refused(exc, shown, "not given"), USAGE)
    with connect() as api:
        current = api.get_deployment(name)
        if current.autoscale is not None and not given:
            updated = current
        else:
            origin = "the deployment's current value" if current.autoscale else "the default"
            base = current.autoscale or AutoscalePolicy()
            try:
                policy = AutoscalePolicy.model_validate(base.model_dump() | given)
            except ValidationError as exc:
                fail(_autoscale_refused(exc, shown, origin), USAGE)
            updated = api.send(calls.set_autoscale(name, policy))
    if as_json:
        print_json(plain(updated))
        return
    # The decision's and the starved reason are the control plane's words: printed inert.
    print(printable(summary(updated, datetime.now(UTC))))


def register(deploy_app: typer.Typer) -> None:
    """Attach `autoscale` to `dctl deploy`."""
    deploy_app.command("autoscale")(deploy_autoscale)
