"""What the supervisor starts for an instance, by engine kind: one `LaunchPlan`.

    dctl     python -m engine.serve --config instance-N.yaml      (the engine config, key in it)
    vllm     PYTHON -m vllm.entrypoints.cli.main serve SNAPSHOT ... --config instance-N.yaml
    sglang   PYTHON -m sglang.launch_server --model-path SNAPSHOT ... --config instance-N.yaml
    command  python -m agent.backends.fronted --config instance-N.yaml
             (the rendered template as its child; the key-checking proxy in front when the
             engine checks no key itself, or when the agent serves its engines over TLS)

In every case the file on the command line is the instance's own 0600 file holding its API key,
and its path is the marker that adopts the process after an agent restart. A plan is pure: the
files it lists are written by the supervisor, and the loopback port of a proxied engine comes
from the injected port picker.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from agent.backends.servers import ServerInstance, key_config, server_argv
from agent.instance_spec import InstanceSpec, api_key_in, engine_config
from protocol.engine_kinds import (
    CommandEngine,
    DctlEngine,
    EngineChoice,
    ServerEngine,
    render,
)

FRONTED = [sys.executable, "-m", "agent.backends.fronted"]
# The dctl engine's probe paths; vLLM and SGLang answer /health for both.
DCTL_READY, DCTL_LIVE = "/health/ready", "/health/live"
LOOPBACK = "127.0.0.1"
_ENGINES: TypeAdapter[EngineChoice] = TypeAdapter(EngineChoice)


@dataclass(frozen=True)
class Probes:
    """Where an engine is probed and scraped (no API key needed on any of them)."""

    ready: str = DCTL_READY
    live: str = DCTL_LIVE
    metrics: str | None = "/metrics"


@dataclass(frozen=True)
class LaunchPlan:
    """One start of one instance: the process, its environment and its private files."""

    argv: list[str]
    files: dict[Path, str]  # written 0600 before the launch; the first is the marker
    env: dict[str, str] = field(default_factory=dict)
    kind: str = "dctl"
    note: str = ""  # for the start message (what listens behind the proxy, ...)

    @property
    def marker(self) -> str:
        """What the process's command line contains (its adoption after an agent restart)."""
        return str(next(iter(self.files)))


def engine_of(spec: InstanceSpec) -> EngineChoice:
    """The engine the instance's config chooses (validated by `engine_config` before)."""
    section = (spec.engine_config or {}).get("engine")
    if not isinstance(section, dict):
        return DctlEngine()
    return _ENGINES.validate_python(section)


def probes(engine: EngineChoice) -> Probes:
    """ENGINE's probe and metrics paths."""
    if isinstance(engine, CommandEngine):
        return Probes(engine.ready_path, engine.probe_live_path, engine.metrics_path)
    if isinstance(engine, ServerEngine):
        return Probes("/health", "/health", "/metrics")
    return Probes()


def plan_launch(
    spec: InstanceSpec,
    config_path: Path,
    dctl_command: list[str],
    pick_port: Callable[[], int],
) -> LaunchPlan:
    """The plan of SPEC's next start; `ServeConfigError` for a config no engine takes."""
    config = engine_config(spec)  # validates the deployment's settings for every kind
    engine = engine_of(spec)
    if isinstance(engine, ServerEngine):
        return _server_plan(engine, spec, config_path)
    if isinstance(engine, CommandEngine):
        return _command_plan(engine, spec, config_path, pick_port)
    config.pop("engine", None)
    return LaunchPlan(
        argv=[*dctl_command, "--config", str(config_path)],
        files={config_path: yaml.safe_dump(config, sort_keys=True)},
    )


def gpu_count(spec: InstanceSpec) -> int:
    """GPUs the instance has (its share of the host; 0 on a host without GPUs)."""
    return len(spec.gpu_indices)


def _server_plan(engine: ServerEngine, spec: InstanceSpec, config_path: Path) -> LaunchPlan:
    instance = ServerInstance(
        python=engine.python or sys.executable,
        model_path=spec.snapshot_path,
        served_name=spec.deployment,
        host=spec.bind_address,
        port=spec.port,
        gpus=gpu_count(spec),
        key_config_path=str(config_path),
        settings=spec.engine_config,
        tls_cert=spec.tls_cert,
        tls_key=spec.tls_key,
    )
    return LaunchPlan(
        argv=server_argv(engine, instance),
        files={config_path: yaml.safe_dump(key_config(spec.deployment, spec.api_key))},
        kind=engine.kind,
    )


def _command_plan(
    engine: CommandEngine, spec: InstanceSpec, config_path: Path, pick_port: Callable[[], int]
) -> LaunchPlan:
    tls = spec.tls_cert is not None and spec.tls_key is not None
    proxied = tls or not engine.checks_keys
    host, port = (LOOPBACK, pick_port()) if proxied else (spec.bind_address, spec.port)
    key_file = config_path.with_suffix(".key")
    values = {
        "model_path": spec.snapshot_path,
        "host": host,
        "port": str(port),
        "served_name": spec.deployment,
        "gpus": str(gpu_count(spec)),
        "api_key_file": str(key_file),
    }
    front: dict[str, Any] = {
        "argv": render(engine.command, values),
        "drain_signal": engine.drain_signal,
        "env": {engine.api_key_env: spec.api_key}
        if engine.api_key_env and spec.api_key is not None
        else {},
    }
    files = {config_path: ""}
    if engine.takes_key_file:
        files[key_file] = spec.api_key or ""
    note = ""
    if proxied:
        paths = probes(engine)
        front["proxy"] = {
            "host": spec.bind_address,
            "port": spec.port,
            "upstream_port": port,
            "api_key": spec.api_key,
            "open_paths": sorted({p for p in (paths.ready, paths.live, paths.metrics) if p}),
            "tls_cert": spec.tls_cert,
            "tls_key": spec.tls_key,
        }
        note = f"behind the agent's key-checking proxy, the engine on {LOOPBACK}:{port}"
    files[config_path] = yaml.safe_dump(front, sort_keys=True)
    return LaunchPlan(argv=[*FRONTED, "--config", str(config_path)], files=files,
                      kind="command", note=note)  # fmt: skip


def saved_api_key(engine: EngineChoice, config_path: Path) -> str | None:
    """The API key an engine started from CONFIG_PATH runs with, read back from the files its
    plan wrote (an adopted engine's: pid records never hold the key)."""
    try:
        data = yaml.safe_load(config_path.read_text()) or {}
        if isinstance(engine, ServerEngine):
            return _text(data.get("api-key"))
        if isinstance(engine, CommandEngine):
            proxy = data.get("proxy") or {}
            key = _text(proxy.get("api_key"))
            if key is None and engine.api_key_env:
                key = _text((data.get("env") or {}).get(engine.api_key_env))
            if key is None and engine.takes_key_file:
                key = config_path.with_suffix(".key").read_text() or None
            return key
        return api_key_in(data)
    except (OSError, yaml.YAMLError, AttributeError):
        return None  # then the spec differs from the desired one and the engine is replaced


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
