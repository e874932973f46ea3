"""How `dctl rollout`, `rollback` and `restart` show a record: the status block, the analysis
and history tables, progress lines, and the exit code a final state means. Text out, no I/O."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from contextlib import redirect_stdout
from typing import TYPE_CHECKING, Any

from cli.exits import FAILURE, OK
from cli.output import Column, print_fields, print_table
from protocol.rollout_states import ACTIVE_STATES, CANARY_KINDS, RolloutKind, RolloutState
from runtime.durations import format_duration

if TYPE_CHECKING:
    from protocol.rollouts import Analysis, MetricUnit, RolloutOut

REASON_WIDTH = 60


def is_final(rollout: RolloutOut) -> bool:
    """Whether ROLLOUT will change no more."""
    return rollout.state not in ACTIVE_STATES


def exit_code(rollout: RolloutOut, rollback: bool = False) -> int:
    """0 when a finished record did what was asked, else 1.

    A rollout succeeds only by promotion. A rollback or restart has nothing to promote, so it
    succeeds by ending at all, unless it was aborted (an instance never came back). For
    `dctl rollback` during a rollout, that rollout ending rolled back is the success.
    """
    if rollout.state == RolloutState.PROMOTED or (
        rollback and rollout.state == RolloutState.ROLLED_BACK
    ):
        return OK
    if rollout.kind in CANARY_KINDS:
        return FAILURE
    return FAILURE if rollout.state == RolloutState.ABORTED else OK


def plan(steps: Sequence[int]) -> str:
    """[10, 50, 100] -> `10% -> 50% -> 100%`."""
    return " -> ".join(f"{w}%" for w in steps) or "-"


def weight_text(weight: int, served: float | None) -> str:
    """The canary's weight and, when known, the share of requests it was served: the split
    clients see can fall far below the weight (`20% (served 2%)`) when gateways eject it."""
    return f"{weight}%" if served is None else f"{weight}% (served {served * 100:.3g}%)"


def format_metric(unit: MetricUnit, value: float | None) -> str:
    """A figure in its UNIT as a person reads it: ratios in %, seconds in ms, counts whole,
    the rest (means, ratios of means) with 2 decimals."""
    if value is None:
        return "-"
    if unit == "ratio":
        return f"{value * 100:.2f}%"
    if unit == "seconds":
        return f"{value * 1000:.0f} ms"
    return f"{value:.0f}" if unit == "count" else f"{value:.2f}"


def _captured(write: Callable[[], None]) -> str:
    # The table and field printers write to stdout; a redraw needs the block as one string.
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        write()
    return buffer.getvalue()


def _versions(rollout: RolloutOut) -> str:
    change = f"{rollout.from_} -> {rollout.to}"
    return f"{change}, engine config changed" if rollout.engine_config_changed else change


def _ready(rollout: RolloutOut) -> str:
    stable = sum(1 for i in rollout.instances if i.pool == "stable")
    stable_of = f"/{stable}" if rollout.instances else ""
    return (
        f"canary {rollout.canary_ready}/{rollout.canary_instances} ready, "
        f"stable {rollout.stable_ready}{stable_of} ready"
    )


ANALYSIS_COLUMNS: list[Column] = [
    ("metric", "metric"),
    ("stable", "stable"),
    ("canary", "canary"),
    ("limit", "limit"),
    ("verdict", "verdict"),
    ("note", "note"),
]

INSTANCE_COLUMNS: list[Column] = [
    ("id", "id"),
    ("host", "host"),
    ("version", "version"),
    ("pool", "pool"),
    ("state", lambda i: "ready" if i["ready"] else i["state"]),
    ("restarts", "restarts"),
]


def analysis_rows(analysis: Analysis) -> list[dict[str, Any]]:
    """One row per metric with its figures formatted for people."""
    return [
        {
            "metric": m.metric,
            "stable": format_metric(m.unit, m.stable),
            "canary": format_metric(m.unit, m.canary),
            "limit": m.limit,
            "verdict": m.verdict,
            "note": m.note,
        }
        for m in analysis.metrics
    ]


def analysis_text(analysis: Analysis) -> str:
    """The heading and table of one analysis."""
    heading = (
        f"analysis of step {analysis.step} at {analysis.weight}%, "
        f"{analysis.time.strftime('%Y-%m-%d %H:%M:%S')}: {analysis.verdict} "
        f"({analysis.stable_requests} stable, {analysis.canary_requests} canary requests)\n"
    )
    rows = analysis_rows(analysis)
    # Notes are rare (why a metric is inconclusive): no column of dashes when there are none.
    columns = ANALYSIS_COLUMNS if any(r["note"] for r in rows) else ANALYSIS_COLUMNS[:-1]
    return heading + _captured(lambda: print_table(rows, columns))


def status_text(rollout: RolloutOut) -> str:
    """`dctl rollout status`: the record's fields, its latest analysis, its instances."""
    fields: dict[str, Any] = {
        "rollout": f"{rollout.id} of {rollout.deployment}",
        "kind": rollout.kind,
        "state": rollout.state,
        "step": f"{rollout.step}/{len(rollout.steps)} at "
        + weight_text(rollout.weight, rollout.served),
        "plan": plan(rollout.steps),
        "phase": rollout.phase,
    }
    if rollout.time_left_s is not None and not is_final(rollout):
        fields["time left"] = format_duration(rollout.time_left_s)
    fields |= {
        "version": _versions(rollout),
        "instances": _ready(rollout),
        "reason": rollout.reason,
    }
    if rollout.staging:
        # Pre-staging: the new snapshot fetched and verified on every host before step 1.
        fields["staging"] = ", ".join(
            f"{s.host} {s.state}" + (f" ({s.error})" if s.error else "") for s in rollout.staging
        )
    text = _captured(lambda: print_fields(fields, [(name, name) for name in fields]))
    if rollout.analysis is not None:
        text += "\n" + analysis_text(rollout.analysis)
    instances = [i.model_dump(mode="json") for i in rollout.instances]
    return (
        text
        + "\n"
        + _captured(lambda: print_table(instances, INSTANCE_COLUMNS, empty="no instances"))
    )


def started_text(rollout: RolloutOut) -> str:
    """What starting a rollout, rollback or restart prints: what, the plan, how to follow."""
    lines = [f"{rollout.kind} {rollout.id} of {rollout.deployment} started: {_versions(rollout)}"]
    if rollout.kind == RolloutKind.ROLLOUT:
        interval = rollout.policy.interval_s
        held = f"{format_duration(interval)} per step" if interval else "the deployment's interval"
        lines.append(f"plan: {plan(rollout.steps)}, {held}")
    lines.append(f"follow it: dctl rollout status {rollout.deployment} --watch")
    return "\n".join(lines) + "\n"


def summary_line(rollout: RolloutOut) -> str:
    """One line after a promote, abort, pause or resume: where the record stands now."""
    step = f"step {rollout.step}/{len(rollout.steps)} at {rollout.weight}%"
    return f"{rollout.kind} {rollout.id} of {rollout.deployment}: {rollout.state}, {step}"


def progress_lines(before: RolloutOut | None, now: RolloutOut) -> list[str]:
    """What changed from BEFORE (None: nothing seen yet) to NOW, one line per change."""
    lines = []
    if before is None or (before.state, before.phase, before.step) != (
        now.state,
        now.phase,
        now.step,
    ):
        why = f": {now.reason}" if now.reason and is_final(now) else ""
        lines.append(f"{now.kind} {now.id}: {now.state}, {now.phase}{why}")
    seen = {i.id: i for i in before.instances} if before is not None else {}
    ready, total = sum(i.ready for i in now.instances), len(now.instances)
    for inst in now.instances:
        old = seen.get(inst.id)
        if old is None or old.model_dump() != inst.model_dump():
            status = "ready" if inst.ready else inst.state
            lines.append(
                f"instance {inst.id} on {inst.host}: {inst.version} {status} ({ready}/{total})"
            )
    return lines


def history_row(rollout: RolloutOut) -> dict[str, Any]:
    """One line of `dctl rollout history`, the reason cut to fit a table."""
    reason = rollout.reason
    if len(reason) > REASON_WIDTH:
        reason = reason[: REASON_WIDTH - 3] + "..."
    return {
        "id": rollout.id,
        "kind": rollout.kind,
        "state": rollout.state,
        "from": rollout.from_,
        "to": rollout.to,
        "steps": plan(rollout.steps),
        "created": rollout.created_at,
        "updated": rollout.updated_at,
        "reason": reason,
    }


HISTORY_COLUMNS: list[Column] = [
    (name, name)
    for name in ("id", "kind", "state", "from", "to", "steps", "created", "updated", "reason")
]
