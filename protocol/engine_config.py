"""The engine server's configuration: a YAML file, every key overridable by a command-line flag.

```yaml
service:   {host: 127.0.0.1, port: 8080, max_concurrent_requests: 32, max_queue: 256,
            request_timeout_s: 120, api_key: null, shutdown_grace_s: 30,
            max_body_bytes: 16777216, unknown_fields: reject,
            tls_cert: null, tls_key: null}
model:     {path: ..., served_name: ..., dtype: bf16, max_seq_len: 4096, block_size: 32,
            threshold: 0.9, steps: null, min_steps: 1, max_steps: 32, thinking: false,
            snapshot_digest: null, resident_weights: auto, packed_weights: auto}
resources: {device: auto, memory_fraction: 0.85, threads: null}
parallel:  {size: null, experts: expert}   # ranks of one instance; null: one per GPU (1 on CPU)
logging:   {level: info, format: json}
chaos:     {error_rate: 0.0, extra_latency_ms: 0}   # fault injection for game days; off
```

Unknown keys and bad values fail at start-up with `ServeConfigError`, one line naming the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from protocol.engine_kinds import (
    ENGINE_KINDS,
    CommandEngine,
    DctlEngine,
    EngineChoice,
    ServerEngine,
    unhonoured_key,
)
from runtime.tls import check_key_file, check_server_files


class ServeConfigError(ValueError):
    """A configuration the server cannot start with; the message is one line naming the key."""


# Bounds of what one engine can hold: tokens of a sequence (a block, its steps), requests
# waiting, bytes of a request body, CPU threads.
MAX_TOKENS = 2**20
MAX_QUEUE = 1_000_000
MAX_BODY_BYTES = 2**30
MAX_THREADS = 4096
# Ranks of one instance: as many as an instance may have GPUs (protocol.rest's
# MAX_GPUS_PER_INSTANCE), or CPU ranks on a host without GPUs.
MAX_PARALLEL_SIZE = 64
TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKENS)]


class _Section(BaseModel):
    # A number that is not finite (YAML's .inf, JSON's Infinity) is no setting of any key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ServiceTuning(_Section):
    """The service keys a deployment may set: admission limits and timeouts."""

    # Requests decoded together (the engine's batch slots); more wait in the queue.
    max_concurrent_requests: Annotated[int, Field(ge=1, le=4096)] = 32
    # Requests allowed to wait for a slot; beyond it the server answers 429.
    max_queue: Annotated[int, Field(ge=0, le=MAX_QUEUE)] = 256
    request_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    # On SIGTERM, running requests get this long to finish before they are aborted.
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0
    # Larger request bodies are refused (413) before they are read or parsed.
    max_body_bytes: Annotated[int, Field(ge=1024, le=MAX_BODY_BYTES)] = 16 * 2**20
    # A request field the API does not know: a 400 naming it (`reject`: a typo never passes
    # silently), or dropped and counted in dllm_request_unknown_fields_total (`ignore`: for
    # clients that send fields of other servers).
    unknown_fields: Literal["reject", "ignore"] = "reject"


class ServiceConfig(ServiceTuning):
    """HTTP side: address, admission limits, timeouts, authentication."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8080
    api_key: str | None = None
    # HTTPS: the key and the certificate (PEM, chain included), both or neither. The key comes
    # first so that the certificate's check sees it.
    tls_key: str | None = None
    tls_cert: Annotated[str | None, Field(validate_default=True)] = None

    @field_validator("tls_key")
    @classmethod
    def _private_key(cls, value: str | None) -> str | None:
        if value is not None:
            check_key_file(value)  # a TlsError is a ValueError: it names the file
        return value

    @field_validator("tls_cert")
    @classmethod
    def _loadable_pair(cls, value: str | None, info: ValidationInfo) -> str | None:
        key = info.data.get("tls_key")
        if value is None and key is None:
            return None
        if value is None or key is None:
            raise ValueError("service.tls_cert and service.tls_key go together")
        check_server_files(value, key)
        return value


class ModelTuning(_Section):
    """The model keys a deployment may set: the default decoding knobs (requests may override)."""

    served_name: str | None = None
    dtype: Literal["fp32", "bf16", "fp16", "auto"] = "bf16"
    max_seq_len: TokenCount = 4096
    # None: the checkpoint's own block size.
    block_size: TokenCount | None = None
    threshold: Annotated[float, Field(gt=0, le=1)] = 0.9
    # Steps mode by default (every block in exactly this many steps; capped at a request's
    # block size); None keeps threshold mode. A request that sets `steps` or `threshold`
    # chooses its own mode.
    steps: TokenCount | None = None
    min_steps: TokenCount = 1
    max_steps: TokenCount | None = None
    thinking: bool = False
    # On a CPU without native bf16/fp16 matmuls the engine computes in fp32. "stored" keeps the
    # weights as the checkpoint stores them and widens each one per matmul; "compute" widens
    # them once at load (faster; twice the weight memory for bf16); "auto" widens at load when
    # the widened weights and the KV cache fit resources.memory_fraction of the machine's RAM.
    resident_weights: Literal["auto", "stored", "compute"] = "auto"
    # On a CPU, projection weights can be kept in oneDNN's packed layout, so no matmul reorders
    # its weight first (same memory, faster matmuls). "auto" packs every projection for bf16 /
    # fp16 computed natively, and for fp32 all but the MoE router and experts (MKL is faster on
    # their few rows); "on" packs everything; "off" keeps the plain layout. Ignored on GPUs.
    packed_weights: Literal["auto", "on", "off"] = "auto"

    @model_validator(mode="after")
    def _steps_fit_the_block(self) -> ModelTuning:
        if self.steps is not None and self.block_size is not None and self.steps > self.block_size:
            raise ValueError(
                f"model.steps ({self.steps}) must be <= model.block_size ({self.block_size})"
            )
        return self


class ModelSection(ModelTuning):
    """Which checkpoint to serve and the default decoding knobs (requests may override them)."""

    path: str
    # Content digest of the weight snapshot, set by the agent; shown in dllm_model_info.
    snapshot_digest: str | None = None

    @field_validator("path")
    @classmethod
    def _checkpoint_dir(cls, value: str) -> str:
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"{value} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"{value} has no config.json (not a checkpoint directory)")
        return str(path)

    @property
    def name(self) -> str:
        """The model name clients send: `served_name`, else the checkpoint directory's name."""
        return self.served_name or Path(self.path).name


class ResourcesConfig(_Section):
    """Device placement and CPU threads."""

    device: str = "auto"
    memory_fraction: Annotated[float, Field(gt=0, le=1)] = 0.85
    threads: Annotated[int, Field(ge=1, le=MAX_THREADS)] | None = None

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", value):
            raise ValueError("must be auto, cpu, cuda, cuda:N or mps")
        return value


class ParallelConfig(_Section):
    """How one instance splits the model over ranks (`torch.distributed`; one process each).

    Attention heads, the dense MLP, the embeddings and the LM head are split across every rank;
    a MoE layer's experts are either placed whole on ranks (`expert`: each holds experts / size
    of them) or each expert's matrices are split across every rank (`tensor`). On GPUs each rank
    owns one GPU of the instance, so `size` is the instance's GPU count; on a CPU the ranks are
    CPU processes (gloo) and `size` is free.
    """

    # None: one rank per GPU the instance gets (its CUDA_VISIBLE_DEVICES); one rank on a CPU.
    size: Annotated[int, Field(ge=1, le=MAX_PARALLEL_SIZE)] | None = None
    experts: Literal["expert", "tensor"] = "expert"


class ChaosConfig(_Section):
    """Fault injection, to rehearse a bad release for real (a canary that fails or is slow).

    Applies to generation requests (completions and chat) that passed authentication; probes,
    metrics and model listing are never touched. Off by default; the server logs a warning at
    start when it is on.
    """

    # Share of generation requests answered with a 500 (code `chaos_injected`), before any work.
    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.0
    # Delay added to every generation request before it is admitted.
    extra_latency_ms: Annotated[int, Field(ge=0, le=600_000)] = 0

    @property
    def active(self) -> bool:
        """Whether any fault is injected."""
        return self.error_rate > 0 or self.extra_latency_ms > 0


class LoggingConfig(_Section):
    """Log level and line format."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["json", "kv"] = "json"


class ServeConfig(_Section):
    """The whole server configuration."""

    service: ServiceConfig = ServiceConfig()
    model: ModelSection
    resources: ResourcesConfig = ResourcesConfig()
    parallel: ParallelConfig = ParallelConfig()
    logging: LoggingConfig = LoggingConfig()
    chaos: ChaosConfig = ChaosConfig()


class DeploymentEngineConfig(_Section):
    """The part of an engine config a deployment sets; the agent fills in the rest per instance.

    Validated by the control plane at `deploy create` / `deploy configure`, so a bad key is a 422
    there instead of a crash loop on every host. `engine` chooses the server (`protocol.
    engine_kinds`); the other sections are the dctl engine's, and another kind takes only the
    keys it maps (`KIND_KEYS`).
    """

    engine: EngineChoice = DctlEngine()
    service: ServiceTuning = ServiceTuning()
    model: ModelTuning = ModelTuning()
    resources: ResourcesConfig = ResourcesConfig()
    parallel: ParallelConfig = ParallelConfig()
    logging: LoggingConfig = LoggingConfig()
    chaos: ChaosConfig = ChaosConfig()

    @model_validator(mode="after")
    def _keys_the_kind_honours(self) -> DeploymentEngineConfig:
        set_keys = [
            f"{section}.{key}"
            for section in self.model_fields_set - {"engine"}
            for key in getattr(self, section).model_fields_set
        ]
        problem = unhonoured_key(self.engine.kind, sorted(set_keys))
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def gpu_ranks(self) -> int | None:
        """`parallel.size` where the ranks run one per GPU; None where it is left to the
        instance's GPU count, or the ranks run on CPUs (no GPU each). Engines other than dctl
        run one instance over its GPUs their own way (tensor parallel = its GPU count)."""
        if self.engine.kind != "dctl":
            return None
        return None if self.resources.device == "cpu" else self.parallel.size


# The model of each engine kind, by the tag that a validation error's location carries.
ENGINE_TYPES: dict[str, type[BaseModel]] = {
    "dctl": DctlEngine, "vllm": ServerEngine, "sglang": ServerEngine, "command": CommandEngine,
}  # fmt: skip


# Keys the agent (or the control plane) decides per instance, and why a deployment cannot.
AGENT_DECIDED_KEYS: dict[str, str] = {
    "service.host": "the agent binds each engine to its host's advertise address",
    "service.port": "the control plane gives each instance its own port",
    "service.api_key": "API keys are managed per instance by the control plane",
    "model.path": "the agent serves the verified snapshot of the deployment's model version",
    "model.snapshot_digest": "the agent sets the digest of the snapshot it serves",
    "model.served_name": "engines serve their deployment's name, which clients and the gateway "
    "route by",
    "service.tls_cert": "the agent gives its engines its host's certificate (engine_tls_cert)",
    "service.tls_key": "the agent gives its engines its host's key (engine_tls_key)",
}


def validate_deployment_config(data: Any) -> dict[str, Any]:
    """DATA as a deployment's engine config, normalised to the keys it set; else ServeConfigError.

    The message names the key: an unknown key, a bad value, or one the agent decides.
    """
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ServeConfigError("engine_config: must be a mapping of sections (service, model, ...)")
    for key, why in AGENT_DECIDED_KEYS.items():
        section, name = key.split(".")
        values = data.get(section)
        if isinstance(values, dict) and name in values:
            raise ServeConfigError(f"engine_config: {key} cannot be set: {why}")
    try:
        config = DeploymentEngineConfig.model_validate(data)
    except ValidationError as exc:
        raise ServeConfigError(
            _describe(dict(exc.errors()[0]), "engine_config", DeploymentEngineConfig)
        ) from None
    return config.model_dump(mode="json", exclude_unset=True)


# Command-line flag -> config key. Flags are the key's last part, except where two sections
# would clash or the bare name reads badly.
FLAGS: dict[str, str] = {
    "host": "service.host",
    "port": "service.port",
    "max-concurrent-requests": "service.max_concurrent_requests",
    "max-queue": "service.max_queue",
    "request-timeout-s": "service.request_timeout_s",
    "api-key": "service.api_key",
    "shutdown-grace-s": "service.shutdown_grace_s",
    "max-body-bytes": "service.max_body_bytes",
    "unknown-fields": "service.unknown_fields",
    "tls-cert": "service.tls_cert",
    "tls-key": "service.tls_key",
    "model": "model.path",
    "served-name": "model.served_name",
    "dtype": "model.dtype",
    "max-seq-len": "model.max_seq_len",
    "block-size": "model.block_size",
    "threshold": "model.threshold",
    "steps": "model.steps",
    "min-steps": "model.min_steps",
    "max-steps": "model.max_steps",
    "thinking": "model.thinking",
    "resident-weights": "model.resident_weights",
    "packed-weights": "model.packed_weights",
    "snapshot-digest": "model.snapshot_digest",
    "device": "resources.device",
    "memory-fraction": "resources.memory_fraction",
    "threads": "resources.threads",
    "parallel": "parallel.size",
    "experts": "parallel.experts",
    "log-level": "logging.level",
    "log-format": "logging.format",
    "chaos-error-rate": "chaos.error_rate",
    "chaos-extra-latency-ms": "chaos.extra_latency_ms",
}

_NULLS = {"null", "none", "~"}


def _describe(error: dict[str, Any], source: str, schema: type[BaseModel] | None = None) -> str:
    loc = _without_tag(tuple(error["loc"]))
    key = ".".join(str(part) for part in loc)
    if error["type"] == "union_tag_invalid":
        kinds = ", ".join(ENGINE_KINDS)
        return f"{source}: {key}.kind must be one of {kinds} (got {error['ctx']['tag']!r})"
    if error["type"] == "extra_forbidden":
        section = _section_model(tuple(error["loc"][:-1]), schema or ServeConfig)
        known = ", ".join(section.model_fields) if section else ""
        return f"{source}: unknown key {key!r} (known keys here: {known})"
    if error["type"] == "missing":
        if key == "model":
            return f"{source}: model.path is required (the checkpoint directory; flag --model)"
        return f"{source}: {key} is required"
    message = str(error["msg"]).removeprefix("Value error, ")
    if not loc:  # a rule across sections: its message names the keys
        return f"{source}: {message}"
    return f"{source}: {key}: {message} (got {error.get('input')!r})"


def _without_tag(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """LOC without the kind a discriminated `engine` section adds (`engine.command.ready_path`
    is the key `engine.ready_path` of a command engine)."""
    if len(loc) > 1 and loc[0] == "engine" and loc[1] in ENGINE_KINDS:
        return (loc[0], *loc[2:])
    return loc


def _section_model(loc: tuple[Any, ...], schema: type[BaseModel]) -> type[BaseModel] | None:
    model: type[BaseModel] = schema
    for part in loc:
        if model is DeploymentEngineConfig and part == "engine":
            continue  # the next part is the kind, which names the engine's model
        if part in ENGINE_TYPES and str(loc[0]) == "engine":
            model = ENGINE_TYPES[part]
            continue
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _apply_override(data: dict[str, Any], key: str, raw: str) -> None:
    section, name = key.split(".")
    target = data.setdefault(section, {})
    if not isinstance(target, dict):
        raise ServeConfigError(f"{section} must be a mapping of keys to values")
    # Flags arrive as text; pydantic's lax mode turns "8080" into 8080 and "true" into True.
    target[name] = None if raw.strip().lower() in _NULLS else raw


def load_serve_config(
    path: str | Path | None, overrides: dict[str, str] | None = None
) -> ServeConfig:
    """Read the YAML file (if any), apply `--flag` overrides (config key -> text), validate."""
    import yaml

    data: dict[str, Any] = {}
    source = str(path) if path else "flags"
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ServeConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise ServeConfigError(f"{path}: not valid YAML{line}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ServeConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded or {}
    for key, raw in (overrides or {}).items():
        _apply_override(data, key, raw)
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as exc:
        raise ServeConfigError(_describe(dict(exc.errors()[0]), source)) from None
