"""`dctl doctor`'s rules: a `FleetSnapshot` in, `Finding`s out, no I/O (see `collect` for that).

Each rule is a pure function of the snapshot; `diagnose` runs them all and orders the findings
most severe first.
"""

from __future__ import annotations

from collections.abc import Callable

from doctor import access, autoscale, backends, hardware, load, serving, uptime
from doctor.findings import SEVERITY_ORDER, Finding, FleetSnapshot

Rule = Callable[[FleetSnapshot], list[Finding]]
# In the order of the troubleshooting chapter: load failures first, hardware last.
RULES: tuple[Rule, ...] = (
    load.snapshot_failures,
    load.failed_instances,
    load.memory_plan,
    load.preflight,
    hardware.host_silent,
    serving.overflow_and_timeouts,
    serving.chaos_left_on,
    serving.queue_at_limit,
    serving.slow_generation,
    serving.queue_vs_compute,
    hardware.gpu_outliers,
    hardware.expert_skew,
    hardware.step_jitter,
    uptime.creeping,
    load.readiness,
    autoscale.limits,
    backends.backend_figures,
    access.anomalies,
)


def diagnose(snapshot: FleetSnapshot) -> list[Finding]:
    """Every finding of every rule, errors first (stable within a severity)."""
    found = [finding for rule in RULES for finding in rule(snapshot)]
    return sorted(found, key=lambda f: SEVERITY_ORDER[f.severity])


def has_error(findings: list[Finding]) -> bool:
    """True when a finding is an error (the command exits 1)."""
    return any(f.severity == "error" for f in findings)


__all__ = ["RULES", "Finding", "FleetSnapshot", "diagnose", "has_error"]
