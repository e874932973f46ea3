"""What one engine instance is (`InstanceSpec`), the engine config generated for it, and the
timings the supervisor applies to it (`SupervisorPolicy`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

# Keys the agent decides; a deployment's engine config cannot override them.
_AGENT_KEYS = {("service", "host"), ("service", "port"), ("model", "path"),
               ("model", "snapshot_digest")}  # fmt: skip


@dataclass(frozen=True)
class InstanceSpec:
    """Everything that defines one engine process; a change to any of it means a new process."""

    instance_id: int
    deployment: str
    digest: str
    snapshot_path: str
    port: int
    gpu_indices: tuple[int, ...] = ()
    engine_config: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"

    def fingerprint(self) -> str:
        """Stable hash of the spec, to tell 'same engine' from 'replace it'."""
        data = json.dumps(asdict(self), sort_keys=True, default=list)
        return hashlib.sha256(data.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceSpec:
        """Inverse of `dataclasses.asdict` (pid files store specs as JSON)."""
        return cls(**{**data, "gpu_indices": tuple(data.get("gpu_indices", ()))})


def engine_config(spec: InstanceSpec) -> dict[str, Any]:
    """The engine's YAML config: the deployment's settings plus what the agent decides."""
    config: dict[str, Any] = {}
    for section, values in spec.engine_config.items():
        if isinstance(values, dict):
            config[section] = {k: v for k, v in values.items() if (section, k) not in _AGENT_KEYS}
        else:
            config[section] = values  # the engine rejects it with a message naming the key
    config.setdefault("service", {}).update(host="127.0.0.1", port=spec.port)
    model = config.setdefault("model", {})
    model.update(path=spec.snapshot_path, snapshot_digest=spec.digest)
    model.setdefault("served_name", spec.deployment)
    config.setdefault("resources", {}).setdefault("device", spec.device)
    config.setdefault("logging", {}).setdefault("format", "json")
    return config


@dataclass(frozen=True)
class SupervisorPolicy:
    """Timings of probes, restarts and draining."""

    startup_grace_s: float = 600.0  # real models take minutes to load
    probe_interval_s: float = 2.0
    liveness_failures: int = 3
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 300.0
    crash_loop_after: int = 5
    stable_after_s: float = 60.0  # ready this long: the failure streak is forgiven
    stop_grace_s: float = 30.0
    log_max_bytes: int = 10 * 1024 * 1024
    log_keep: int = 3

    def backoff_s(self, failures: int) -> float:
        """Delay before restart number FAILURES (1-based) in a streak."""
        return float(min(self.backoff_initial_s * 2 ** max(failures - 1, 0), self.backoff_max_s))
