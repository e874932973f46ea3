"""Green / yellow / red: the rules that colour the dashboard, as data in, decision out.

`Thresholds` holds the numbers (from `[tui]` in the config file, see `tui.settings`); the
functions here say which colour a state or a figure gets, which alerts the fleet raises and what
the stale-data banner says. No textual, no I/O: the tests state each rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from protocol.rest import DeploymentOut, HostOut
from protocol.rollout_states import RolloutState

Level = Literal["ok", "warn", "bad", "idle"]
# The Rich style of each level; "idle" is for what is neither good nor bad (stopped, unknown).
STYLE: dict[Level, str] = {"ok": "green", "warn": "yellow", "bad": "red", "idle": "dim"}

_HOST_STATES: dict[str, Level] = {"ready": "ok", "not_ready": "warn", "unreachable": "bad"}
_INSTANCE_STATES: dict[str, Level] = {
    "ready": "ok",
    "pending": "warn",
    "downloading": "warn",
    "starting": "warn",
    "stopping": "warn",
    "backoff": "bad",
    "unhealthy": "bad",
    "crash_loop": "bad",
    "failed": "bad",
    "stopped": "idle",
}
_ROLLOUT_STATES: dict[str, Level] = {
    RolloutState.PROGRESSING: "warn",
    RolloutState.PAUSED: "warn",
    RolloutState.PROMOTED: "ok",
    RolloutState.COMPLETED: "ok",
    RolloutState.ABORTED: "bad",
    RolloutState.ROLLED_BACK: "bad",
}
_VERDICTS: dict[str, Level] = {
    "pass": "ok", "fail": "bad", "inconclusive": "warn", "starved": "warn", "n/a": "idle",
}  # fmt: skip
_CHECKS: dict[str, Level] = {"pass": "ok", "warn": "warn", "fail": "bad"}


@dataclass(frozen=True)
class Thresholds:
    """Where a figure turns yellow (`*_warn`) and red (`*_bad`)."""

    gpu_memory_warn: float = 0.80  # fraction of the GPU's memory in use
    gpu_memory_bad: float = 0.95
    gpu_temp_warn_c: float = 80.0
    gpu_temp_bad_c: float = 90.0
    error_rate_warn: float = 0.01  # errors / requests
    error_rate_bad: float = 0.05
    p95_warn_s: float = 2.0
    p95_bad_s: float = 10.0
    heartbeat_warn_intervals: float = 3.0  # heartbeat age, in the host's heartbeat intervals
    heartbeat_bad_intervals: float = 10.0


def _rising(value: float | None, warn: float, bad: float) -> Level:
    """For figures where more is worse."""
    if value is None:
        return "idle"
    if value >= bad:
        return "bad"
    return "warn" if value >= warn else "ok"


def host_state(state: str, draining: bool = False) -> Level:
    """A host's health state; a draining host is yellow even when ready."""
    level = _HOST_STATES.get(state, "warn")
    return "warn" if draining and level == "ok" else level


def instance_state(state: str) -> Level:
    """An instance's observed state."""
    return _INSTANCE_STATES.get(state, "warn")


def rollout_state(state: str) -> Level:
    """A rollout's state: active ones are yellow, promoted green, aborted / rolled back red."""
    return _ROLLOUT_STATES.get(state, "idle")


def verdict(value: str) -> Level:
    """An analysis verdict: pass green, fail red, inconclusive and starved yellow."""
    return _VERDICTS.get(value, "idle")


def check_status(value: str) -> Level:
    """A preflight check's status."""
    return _CHECKS.get(value, "idle")


def autoscale(deployment: DeploymentOut) -> Level:
    """An autoscaled deployment: red when starved below its minimum, yellow when starved or
    pinned at its maximum, else green; idle when it is not autoscaled or not yet reported."""
    policy, status = deployment.autoscale, deployment.autoscale_status
    if policy is None or status is None:
        return "idle"
    if status.starved_since is not None:
        return "bad" if status.serving_ready < policy.min else "warn"
    return "warn" if status.pinned_at_max_since is not None else "ok"


def ready_ratio(ready: int, total: int) -> Level:
    """Instances ready out of total: all green, some yellow, none red (nothing: idle)."""
    if total == 0:
        return "idle"
    if ready == total:
        return "ok"
    return "warn" if ready else "bad"


def gpu_memory(used: int, total: int, limits: Thresholds) -> Level:
    """GPU memory in use against its size."""
    if total <= 0:
        return "idle"
    return _rising(used / total, limits.gpu_memory_warn, limits.gpu_memory_bad)


def gpu_temperature(celsius: float | None, limits: Thresholds) -> Level:
    """A GPU's temperature; unknown (N/A) is idle."""
    return _rising(celsius, limits.gpu_temp_warn_c, limits.gpu_temp_bad_c)


def ecc(uncorrectable: int | None) -> Level:
    """Any uncorrectable ECC error is red."""
    if uncorrectable is None:
        return "idle"
    return "bad" if uncorrectable > 0 else "ok"


def error_rate(rate: float | None, limits: Thresholds) -> Level:
    """A deployment's or version's error rate (0..1)."""
    return _rising(rate, limits.error_rate_warn, limits.error_rate_bad)


def latency(p95_s: float | None, limits: Thresholds) -> Level:
    """A p95 latency in seconds."""
    return _rising(p95_s, limits.p95_warn_s, limits.p95_bad_s)


def heartbeat(age_s: float | None, interval_s: float, limits: Thresholds) -> Level:
    """How old a host's last heartbeat is, counted in its own heartbeat intervals."""
    if age_s is None:
        return "bad"
    beats = age_s / interval_s if interval_s > 0 else 0.0
    return _rising(beats, limits.heartbeat_warn_intervals, limits.heartbeat_bad_intervals)


@dataclass(frozen=True)
class Alert:
    """Something an operator should look at, most severe first when sorted by `rank`."""

    level: Level
    subject: str
    text: str

    @property
    def rank(self) -> int:
        """Sort key: red before yellow."""
        return 0 if self.level == "bad" else 1


def alerts(hosts: Iterable[HostOut], deployments: Iterable[DeploymentOut]) -> list[Alert]:
    """Crash loops, hosts not ready, failed preflight checks, snapshot verification failures and
    autoscalers starved of GPUs or pinned at their maximum, red first."""
    found: list[Alert] = []
    for host in hosts:
        if host.state != "ready":
            found.append(Alert(host_state(host.state), host.name, f"host {host.state}"))
        facts = host.facts
        if facts is None:
            continue
        for check in facts.preflight:
            if check.status == "fail":
                reason = f": {check.reason}" if check.reason else ""
                found.append(Alert("bad", host.name, f"preflight {check.name} failed{reason}"))
        for failure in facts.snapshot_failures:
            text = f"snapshot {failure.digest.removeprefix('sha256:')[:12]} failed verification"
            found.append(Alert("bad", host.name, f"{text}: {failure.error}".rstrip(": ")))
    for deployment in deployments:
        status = deployment.autoscale_status
        if deployment.autoscale is not None and status is not None:
            if status.starved_since is not None:
                why = status.starved_reason or "fewer instances placed than it wants"
                found.append(Alert(autoscale(deployment), deployment.name, f"starved: {why}"))
            if status.pinned_at_max_since is not None:
                text = f"autoscale pinned at max {deployment.autoscale.max}"
                found.append(Alert("warn", deployment.name, text))
        for instance in deployment.instances:
            if instance.observed_state == "crash_loop":
                subject = f"{deployment.name}/{instance.id}"
                text = f"crash loop on {instance.host} ({instance.restart_count} restarts)"
                found.append(Alert("bad", subject, text))
    return sorted(found, key=lambda alert: alert.rank)


def stale_banner(
    age_s: float | None, error: str | None, slow: bool, unreachable: bool = True
) -> str | None:
    """The banner over stale data, or None while the last refresh worked and none is late.

    AGE_S is how old the newest data on screen is (None: nothing arrived yet); ERROR what the
    last failed refresh said, UNREACHABLE whether it got no answer at all (else the control
    plane answered with an error); SLOW that a refresh has been waiting longer than it should.
    """
    if error is None and not slow:
        return None
    if error is None:
        what = "control plane slow"
    else:
        what = "control plane unreachable" if unreachable else "control plane error"
    since = "no data yet" if age_s is None else f"data from {round(age_s)} s ago"
    return f"{what} — {since}" + (f": {error}" if error else "")
