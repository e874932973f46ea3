"""What one engine instance is (`InstanceSpec`), the engine config generated for it, and the
timings the supervisor applies to it (`SupervisorPolicy`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from protocol.engine_config import (
    AGENT_DECIDED_KEYS,
    ServeConfigError,
    validate_deployment_config,
)

# Addresses that mean "every interface": fine to listen on, but not to connect to.
_ANY_ADDRESS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


@dataclass(frozen=True)
class InstanceSpec:
    """Everything that defines one engine process; a change to any of it means a new process.

    `api_key` is a secret: it is left out of `repr` and of `record()` (what pid files store),
    and reaches the engine only through its 0600 config file. `tls_cert`/`tls_key` are the paths
    of the agent's engine certificate (None: plain HTTP); being part of the spec, turning TLS on
    or off replaces the engines.
    """

    instance_id: int
    deployment: str
    digest: str
    snapshot_path: str
    port: int
    gpu_indices: tuple[int, ...] = ()
    engine_config: dict[str, Any] = field(default_factory=dict)
    device: str = "auto"
    bind_address: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    # CPU threads for an engine config that sets none (`agent.cpu_threads`); None: torch's own.
    threads: int | None = None

    def fingerprint(self) -> str:
        """Stable hash of the spec, to tell 'same engine' from 'replace it'.

        The API key is part of it, so a new key restarts the engine; 64 bits of a SHA-256 over
        a random key reveal nothing about it. The default `threads` is not: it follows how many
        instances the host has, and a scale-up or a surge canary must not replace the engines
        already serving; an engine gets the current figure at its next start.
        """
        data = asdict(self)
        del data["threads"]
        text = json.dumps(data, sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def probe_address(self) -> str:
        """Where the agent reaches the engine: its bind address (loopback for a wildcard one)."""
        return _ANY_ADDRESS.get(self.bind_address, self.bind_address)

    def record(self) -> dict[str, Any]:
        """The spec as pid files store it: everything but the API key."""
        data = asdict(self)
        del data["api_key"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], api_key: str | None = None) -> InstanceSpec:
        """Inverse of `record()`; keys that another agent version wrote are ignored."""
        known = {f.name for f in fields(cls)} - {"api_key"}
        values = {k: v for k, v in data.items() if k in known}
        values["gpu_indices"] = tuple(values.get("gpu_indices", ()))
        return cls(**values, api_key=api_key)


def deployment_settings(engine_config: Any) -> dict[str, Any]:
    """The deployment's part of an engine config, checked; raises `ServeConfigError`.

    Keys the agent decides per instance (`AGENT_DECIDED_KEYS`) are dropped, whatever their
    value; the rest must be what the engine accepts (the engine's own schema, from the same
    `protocol`), so a bad config fails its instance here, with a message naming the key, instead
    of the agent or a crash-looping engine.
    """
    if not isinstance(engine_config, dict):
        raise ServeConfigError("engine_config: must be a mapping of sections (service, model, ...)")
    kept: dict[str, Any] = {}
    for section, values in engine_config.items():
        if isinstance(values, dict):
            values = {k: v for k, v in values.items() if f"{section}.{k}" not in AGENT_DECIDED_KEYS}
        kept[section] = values
    return validate_deployment_config(kept)


def engine_config(spec: InstanceSpec) -> dict[str, Any]:
    """The engine's YAML config: the deployment's settings plus what the agent decides.

    Raises `ServeConfigError` when the deployment's settings are not a valid engine config.
    """
    config = deployment_settings(spec.engine_config)
    service = config.setdefault("service", {})
    service.update(host=spec.bind_address, port=spec.port)
    if spec.api_key is not None:
        service["api_key"] = spec.api_key
    if spec.tls_cert is not None and spec.tls_key is not None:
        service.update(tls_cert=spec.tls_cert, tls_key=spec.tls_key)
    model = config.setdefault("model", {})
    model.update(path=spec.snapshot_path, snapshot_digest=spec.digest)
    # Clients name the deployment (through the gateway or not): another name would be a 404.
    model["served_name"] = spec.deployment
    resources = config.setdefault("resources", {})
    resources.setdefault("device", spec.device)
    if resources.get("threads") is None and spec.threads is not None:
        resources["threads"] = spec.threads
    config.setdefault("logging", {}).setdefault("format", "json")
    return config


def threads_note(spec: InstanceSpec, config: dict[str, Any]) -> str:
    """The engine's CPU threads as its launch message gives them, and who chose them ("" when
    neither its config nor the agent sets any: torch's own default)."""
    threads = config.get("resources", {}).get("threads")
    if threads is None:
        return ""
    # The spec's config is the deployment's, already validated by `engine_config()`.
    configured = spec.engine_config.get("resources", {}) if spec.engine_config else {}
    by_config = isinstance(configured, dict) and configured.get("threads") is not None
    who = "engine config" if by_config else "agent default: the host's cores / its instances"
    return f"{threads} CPU thread{'' if threads == 1 else 's'} ({who})"


def api_key_in(config: dict[str, Any]) -> str | None:
    """The API key an engine config (as `engine_config` wrote it) holds, if any."""
    service = config.get("service")
    key = service.get("api_key") if isinstance(service, dict) else None
    return key if isinstance(key, str) else None


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
