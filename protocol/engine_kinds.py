"""Which server runs a deployment's instances: the `engine` section of its engine config.

```yaml
engine: {kind: dctl}                       # the bundled block-diffusion engine (the default)
engine: {kind: vllm, extra_args: [--enable-prefix-caching], python: /opt/vllm/bin/python}
engine: {kind: sglang, extra_args: [--enable-torch-compile]}
engine: {kind: command,                     # any OpenAI-compatible server
         command: [my-server, --host, "{host}", --port, "{port}", --model, "{model_path}"],
         ready_path: /health, metrics_path: /metrics, drain_signal: SIGTERM,
         api_key_env: MY_SERVER_API_KEY}    # optional: see below
```

`vllm` and `sglang` get their command lines from the deployment: the verified snapshot as the
model, the deployment's name as the served name, the agent's host and port, tensor parallel =
the instance's GPUs, and `model.dtype`, `model.max_seq_len`, `service.max_concurrent_requests`
and `resources.memory_fraction` where the config sets them. A `command` is an argv template whose
arguments may hold the placeholders `PLACEHOLDERS` (`{host}` and `{port}` are required: the
agent decides where each instance listens). The instance's API key never goes on a command line:
vLLM and SGLang read it from a 0600 `--config` file; a `command` engine reads it from the
environment variable `api_key_env`, or from a 0600 file whose path is the `{api_key_file}`
placeholder; an engine that takes neither listens on loopback behind the agent's key-checking
proxy on the instance's address.

These models only describe; the agent turns them into processes (`agent.backends`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

EngineKind = Literal["dctl", "vllm", "sglang", "command"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("dctl", "vllm", "sglang", "command")
# What a `command` template's arguments may name, and what each becomes.
PLACEHOLDERS: dict[str, str] = {
    "model_path": "the verified weight snapshot's directory",
    "host": "the address the server must listen on",
    "port": "the port the server must listen on",
    "served_name": "the model name clients send (the deployment's name)",
    "gpus": "how many GPUs the instance has (0 on a host without GPUs)",
    "api_key_file": "a 0600 file holding the instance's API key",
}
REQUIRED_PLACEHOLDERS = ("host", "port")
# Arguments dctl sets itself for vLLM and SGLang: an extra argument may not set them again.
MANAGED_FLAGS: dict[str, tuple[str, ...]] = {
    "vllm": ("--model", "--host", "--port", "--served-model-name", "--api-key", "--config",
             "--tensor-parallel-size", "-tp", "--ssl-keyfile", "--ssl-certfile"),
    "sglang": ("--model-path", "--model", "--host", "--port", "--served-model-name", "--api-key",
               "--config", "--tp-size", "--tp", "--tensor-parallel-size", "--ssl-keyfile",
               "--ssl-certfile"),
}  # fmt: skip
MAX_ARGS = 256
MAX_ARG_CHARS = 4096
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@/%-]*")
# Control characters (C0 but tab, DEL, C1) and NUL cannot be in an argument: argv is NUL-
# terminated, and a newline in a flag is always a mistake.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")

DrainSignal = Literal["SIGTERM", "SIGINT", "SIGQUIT", "SIGHUP", "SIGUSR1", "SIGUSR2"]
Argument = Annotated[str, Field(max_length=MAX_ARG_CHARS)]


class _Engine(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class DctlEngine(_Engine):
    """The bundled engine (`python -m engine.serve`), configured by the other sections."""

    kind: Literal["dctl"] = "dctl"


class ServerEngine(_Engine):
    """vLLM or SGLang, installed in the agent's environment or in the one `python` names."""

    kind: Literal["vllm", "sglang"]
    # The interpreter of the environment that has the engine installed; None: the agent's own.
    python: Annotated[str, Field(min_length=1, max_length=MAX_ARG_CHARS)] | None = None
    # Appended to the generated command line, after dctl's own arguments.
    extra_args: Annotated[list[Argument], Field(max_length=MAX_ARGS)] = []

    @field_validator("python")
    @classmethod
    def _absolute_interpreter(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("must be an absolute path to a Python interpreter")
        if value is not None and _CONTROL.search(value):
            raise ValueError("must not contain control characters")
        return value

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flag(cls, value: list[str], info: ValidationInfo) -> list[str]:
        managed = MANAGED_FLAGS.get(info.data.get("kind", ""), ())
        for n, arg in enumerate(value):
            if _CONTROL.search(arg):
                raise ValueError(f"extra_args[{n}] contains a control character")
            flag = arg.split("=", 1)[0]
            if flag in managed:
                raise ValueError(
                    f"extra_args[{n}] sets {flag}, which dctl sets for every instance "
                    "(model path, address, served name, API key, tensor parallel, TLS)"
                )
        return value


class CommandEngine(_Engine):
    """Any OpenAI-compatible server, started from an argv template (no shell)."""

    kind: Literal["command"]
    command: Annotated[list[Argument], Field(min_length=1, max_length=MAX_ARGS)]
    # Answers 200 once the server can take requests; probed without an API key.
    ready_path: str = "/health"
    # Answers 200 while the server runs (None: the ready path).
    live_path: str | None = None
    # Prometheus text exposition (None: the server has none; its figures come from the gateway).
    metrics_path: str | None = "/metrics"
    # What the agent sends to drain the server (then SIGKILL after the grace period).
    drain_signal: DrainSignal = "SIGTERM"
    # The environment variable the server reads its API key from (None: see `api_key_file`).
    api_key_env: str | None = None

    @field_validator("command")
    @classmethod
    def _template(cls, value: list[str]) -> list[str]:
        seen: set[str] = set()
        for n, arg in enumerate(value):
            if _CONTROL.search(arg):
                raise ValueError(f"command[{n}] contains a control character")
            seen |= placeholders_in(arg, f"command[{n}]")
        if "{" in value[0] or "}" in value[0]:
            raise ValueError("command[0] is the program to run: it cannot hold a placeholder")
        missing = [name for name in REQUIRED_PLACEHOLDERS if name not in seen]
        if missing:
            names = ", ".join("{" + name + "}" for name in missing)
            raise ValueError(
                f"the command must pass {names} to the server: the agent decides where each "
                "instance listens"
            )
        return value

    @field_validator("ready_path", "live_path", "metrics_path")
    @classmethod
    def _url_path(cls, value: str | None) -> str | None:
        if value is not None and not _PATH.fullmatch(value):
            raise ValueError("must be a URL path starting with / (no query, no spaces)")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.fullmatch(value):
            raise ValueError("must be an environment variable name (letters, digits, _)")
        return value

    @property
    def probe_live_path(self) -> str:
        """Where liveness is probed."""
        return self.live_path or self.ready_path

    @property
    def takes_key_file(self) -> bool:
        """Whether the template passes the API key's file to the server."""
        return any("api_key_file" in placeholders_in(arg, "") for arg in self.command)

    @property
    def checks_keys(self) -> bool:
        """Whether the server itself checks the API key (else the agent's proxy does)."""
        return self.api_key_env is not None or self.takes_key_file


EngineChoice = Annotated[DctlEngine | ServerEngine | CommandEngine, Field(discriminator="kind")]


def engine_kind(engine_config: Mapping[str, Any] | None) -> str:
    """The engine kind a (stored, validated) engine config chooses: `dctl` when it sets none."""
    section = (engine_config or {}).get("engine")
    kind = section.get("kind") if isinstance(section, Mapping) else None
    return kind if isinstance(kind, str) else "dctl"


# The figures each kind's instances report to the heartbeat, beyond what the gateway measures
# for every kind (requests, errors, latency, TTFT, tokens). The diffusion figures are the dctl
# engine's alone; a command engine's depend on what it exports (mapped where known).
DIFFUSION_FIGURES = ("denoising steps per block", "tokens per forward")
REPORTED_FIGURES: dict[str, tuple[str, ...]] = {
    "dctl": ("requests running and waiting", "TTFT", "tokens", *DIFFUSION_FIGURES,
             "expert load"),
    "vllm": ("requests running and waiting", "TTFT", "tokens"),
    "sglang": ("requests running and waiting", "TTFT", "tokens"),
    "command": (),
}  # fmt: skip


def placeholders_in(arg: str, where: str) -> set[str]:
    """The placeholder names in ARG (`{{` and `}}` are literal braces); ValueError naming WHERE
    for an unknown name, a positional `{}`, a format spec or an unbalanced brace."""
    try:
        parts = list(string.Formatter().parse(arg))
    except ValueError:
        brace = "an unbalanced brace (write {{ or }} for a literal one)"
        raise ValueError(f"{where} has {brace}") from None
    names = set()
    for _literal, name, spec, conversion in parts:
        if name is None:
            continue
        if spec or conversion:
            raise ValueError(f"{where}: {{{name}...}} cannot carry a format or conversion")
        if name not in PLACEHOLDERS:
            known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
            raise ValueError(f"{where}: unknown placeholder {{{name}}} (known: {known})")
        names.add(name)
    return names


def render(template: list[str], values: dict[str, str]) -> list[str]:
    """TEMPLATE with every placeholder replaced by VALUES (validated templates only)."""
    return [arg.format_map(values) for arg in template]


# The engine config keys each kind honours, beside `engine` itself. The dctl engine honours all
# of them; vLLM and SGLang the ones dctl maps to their flags; a command none (its template says
# everything). A key set for a kind that would ignore it is refused: a setting that silently does
# nothing is worse than an error.
KIND_KEYS: dict[str, frozenset[str] | None] = {
    "dctl": None,
    "vllm": frozenset({"model.dtype", "model.max_seq_len", "service.max_concurrent_requests",
                       "resources.memory_fraction", "logging.level"}),
    "sglang": frozenset({"model.dtype", "model.max_seq_len", "service.max_concurrent_requests",
                         "resources.memory_fraction", "logging.level"}),
    "command": frozenset(),
}  # fmt: skip


def unhonoured_key(kind: str, set_keys: list[str]) -> str | None:
    """The first of SET_KEYS (`section.key`) a KIND engine would not honour, with why."""
    honoured = KIND_KEYS.get(kind)
    if honoured is None:
        return None
    for key in set_keys:
        if key not in honoured:
            if kind == "command":
                return (
                    f"{key} is a setting of the dctl engine; a command engine takes its "
                    "settings from engine.command"
                )
            allowed = ", ".join(sorted(honoured))
            return (
                f"{key} is a setting of the dctl engine, which {kind} does not take (dctl maps "
                f"{allowed}; pass anything else in engine.extra_args)"
            )
    return None
