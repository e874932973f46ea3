"""vLLM and SGLang command lines, built from the deployment (pure: golden-tested).

Both read a YAML file of their long options with `--config` (argv wins where both set one), so
the instance's API key goes in that 0600 file and never on the command line, which every local
user can read in `/proc`. Everything else stays on argv, where an operator sees it in `ps`.
Both answer `GET /health` once the model is loaded and export Prometheus text at `/metrics`
(SGLang with `--enable-metrics`, which is always given).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.engine_kinds import ServerEngine

# Our dtype names -> the torch names both servers take.
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}
# The config keys dctl maps, per server: key -> flag.
_VLLM_FLAGS = {
    "model.max_seq_len": "--max-model-len",
    "service.max_concurrent_requests": "--max-num-seqs",
    "resources.memory_fraction": "--gpu-memory-utilization",
    "logging.level": "--uvicorn-log-level",
}
_SGLANG_FLAGS = {
    "model.max_seq_len": "--context-length",
    "service.max_concurrent_requests": "--max-running-requests",
    "resources.memory_fraction": "--mem-fraction-static",
    "logging.level": "--log-level",
}


@dataclass(frozen=True)
class ServerInstance:
    """What one instance's server is told: where it runs, what it serves, on how many GPUs."""

    python: str
    model_path: str
    served_name: str
    host: str
    port: int
    gpus: int
    key_config_path: str
    settings: Mapping[str, Any]  # the deployment's engine config (the keys it set)
    tls_cert: str | None = None
    tls_key: str | None = None


def server_argv(engine: ServerEngine, instance: ServerInstance) -> list[str]:
    """The command line of ENGINE's server for INSTANCE (no secret on it)."""
    tensor_parallel = str(max(instance.gpus, 1))
    if engine.kind == "vllm":
        head = [instance.python, "-m", "vllm.entrypoints.cli.main", "serve", instance.model_path]
        flags = _VLLM_FLAGS
        tp_flag = "--tensor-parallel-size"
    else:
        head = [instance.python, "-m", "sglang.launch_server", "--model-path", instance.model_path]
        flags = _SGLANG_FLAGS
        tp_flag = "--tp-size"
    argv = [
        *head,
        "--served-model-name", instance.served_name,
        "--host", instance.host,
        "--port", str(instance.port),
        tp_flag, tensor_parallel,
    ]  # fmt: skip
    if engine.kind == "sglang":
        argv.append("--enable-metrics")
    dtype = _setting(instance.settings, "model.dtype")
    if dtype is not None:
        argv += ["--dtype", TORCH_DTYPES[str(dtype)]]
    for key, flag in flags.items():
        value = _setting(instance.settings, key)
        if value is not None:
            argv += [flag, str(value)]
    if instance.tls_cert is not None and instance.tls_key is not None:
        argv += ["--ssl-keyfile", instance.tls_key, "--ssl-certfile", instance.tls_cert]
    return [*argv, "--config", instance.key_config_path, *engine.extra_args]


def key_config(served_name: str, api_key: str | None) -> dict[str, str]:
    """The `--config` file's content: the API key (when the instance has one). The served name
    is repeated there, so the file is never empty (both servers refuse an empty config)."""
    config = {"served-model-name": served_name}
    if api_key is not None:
        config["api-key"] = api_key
    return config


def _setting(settings: Mapping[str, Any], key: str) -> Any:
    section, name = key.split(".")
    values = settings.get(section)
    return values.get(name) if isinstance(values, Mapping) else None
