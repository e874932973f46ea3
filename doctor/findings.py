"""What the doctor reads (`FleetSnapshot`) and what it says (`Finding`): plain data, no I/O."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

from protocol.engine_config import ChaosConfig, ModelTuning, ResourcesConfig, ServiceTuning
from protocol.gateway import DeploymentTraffic
from protocol.logs import AuditReport
from protocol.rest import DeploymentOut, HostOut, InstanceOut, VersionOut
from protocol.version_ref import VersionRef

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "info": 2}
# One downsampled series: (bucket start, value) points, oldest first. Counters (histograms'
# `_sum`/`_count` among them) hold the delta of each 10 s bucket, gauges the last value.
Points = list[tuple[datetime, float]]
Evidence = dict[str, float | int | str]


@dataclass(frozen=True)
class Finding:
    """One thing wrong (or worth knowing): how bad, about what, the figures, and what to do."""

    rule: str
    severity: Severity
    subject: str
    summary: str
    evidence: Evidence
    fix: str

    def to_json(self) -> dict[str, Any]:
        """The finding as JSON-ready data (`dctl doctor --json`)."""
        return asdict(self)


@dataclass
class FleetSnapshot:
    """Live state and recent samples of the part of the fleet the doctor looks at."""

    deployments: list[DeploymentOut] = field(default_factory=list)
    # The deployments' versions (their memory plans), by MODEL:VERSION.
    versions: dict[VersionRef, VersionOut] = field(default_factory=dict)
    # Hosts with their facts, latest GPU samples and instances.
    hosts: list[HostOut] = field(default_factory=list)
    # Host name -> its GPU series (`gpu0.temperature_c`, ...).
    host_series: dict[str, dict[str, Points]] = field(default_factory=dict)
    # Instance id -> its engine series (`dllm_requests_waiting`, ...).
    instance_series: dict[int, dict[str, Points]] = field(default_factory=dict)
    # Deployment name -> what the gateways served it recently.
    traffic: dict[str, DeploymentTraffic] = field(default_factory=dict)
    # The access audit of client tokens (admin only): None when it was not read.
    audit: AuditReport | None = None
    # What could not be looked at, and why ("access.audit skipped: ..."): shown, never a finding.
    notes: list[str] = field(default_factory=list)

    def instances(self) -> list[tuple[DeploymentOut, InstanceOut]]:
        """Every instance of the deployments looked at, on the hosts looked at."""
        hosts = {h.name for h in self.hosts}
        return [(d, i) for d in self.deployments for i in d.instances if i.host in hosts]

    def host(self, name: str) -> HostOut | None:
        """The host called NAME, if it is looked at."""
        return next((h for h in self.hosts if h.name == name), None)


# --- engine config as deployed (defaults from the engine's own config classes) ----------------


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name)
    return value if isinstance(value, Mapping) else {}


def configured(deployment: DeploymentOut, section: str, key: str) -> Any:
    """Engine config value SECTION.KEY of DEPLOYMENT, or the engine's default for it."""
    defaults: dict[str, Any] = {
        "service": ServiceTuning().model_dump(),
        "model": ModelTuning().model_dump(),
        "resources": ResourcesConfig().model_dump(),
        "chaos": ChaosConfig().model_dump(),
    }
    own = _section(deployment.engine_config, section)
    return own[key] if key in own else defaults.get(section, {}).get(key)


# --- reading series -----------------------------------------------------------------------------


def total(points: Iterable[tuple[datetime, float]]) -> float:
    """Sum of a counter's bucket deltas: how much it grew over the window."""
    return sum(value for _, value in points)


def matching(series: Mapping[str, Points], name: str) -> list[tuple[str, Points]]:
    """Series called NAME, with or without `{labels}`."""
    return [(key, pts) for key, pts in series.items() if key == name or key.startswith(name + "{")]


def label(series_name: str, key: str) -> str | None:
    """The value of label KEY in `name{a="1",key="v"}`, or None."""
    _, _, inner = series_name.partition("{")
    for pair in inner.rstrip("}").split(","):
        k, _, v = pair.partition("=")
        if k == key:
            return v.strip('"')
    return None


def histogram_mean(series: Mapping[str, Points], name: str) -> float | None:
    """sum(NAME_sum) / sum(NAME_count) over the window, all label sets; None without counts."""
    sums = sum(total(p) for _, p in matching(series, f"{name}_sum"))
    counts = sum(total(p) for _, p in matching(series, f"{name}_count"))
    return sums / counts if counts else None


def median(values: Iterable[float]) -> float | None:
    """The median, or None of nothing."""
    values = list(values)
    return statistics.median(values) if values else None


def gib(value: float) -> float:
    """Bytes in GiB, rounded for evidence."""
    return round(value / 2**30, 1)
