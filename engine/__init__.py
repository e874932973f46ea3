"""dctl's inference engine for MoE block-diffusion language models.

Public names are re-exported here. Torch-free ones are imported at once; the rest load on first
use (PEP 562), so `import engine.config` / `engine.memory` never pulls in torch: the CLI and the
agent rely on that. To export a torch-dependent name, add it to `_LAZY` (name -> module).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.config import ModelConfig
from engine.errors import CheckpointError, ContextLengthExceeded, EngineError, InvalidParams
from engine.memory import MemoryPlan, plan_memory
from engine.params import SamplingParams

_LAZY: dict[str, str] = {
    "Model": "engine.model",
    "KVCache": "engine.kv_cache",
    "load_model": "engine.loader",
    "load_tokenizer": "engine.loader",
    "load_checkpoint_config": "engine.loader",
    "Tokenizer": "engine.tokenizer",
    "LLM": "engine.llm",
    "RequestOutput": "engine.llm",
    "EngineCore": "engine.core",
    "RequestUpdate": "engine.core",
    "RequestStats": "engine.core",
    "StepStats": "engine.core",
    "create_demo_checkpoint": "engine.demo_checkpoint",
    "build_engine": "engine.factory",
    "EngineOptions": "engine.factory",
    "ServeConfig": "protocol.engine_config",
    "load_serve_config": "protocol.engine_config",
}

if TYPE_CHECKING:
    from engine.core import EngineCore, RequestStats, RequestUpdate, StepStats
    from engine.demo_checkpoint import create_demo_checkpoint
    from engine.factory import EngineOptions, build_engine
    from engine.kv_cache import KVCache
    from engine.llm import LLM, RequestOutput
    from engine.loader import load_checkpoint_config, load_model, load_tokenizer
    from engine.model import Model
    from engine.tokenizer import Tokenizer
    from protocol.engine_config import ServeConfig, load_serve_config


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "CheckpointError",
    "ContextLengthExceeded",
    "EngineCore",
    "EngineError",
    "EngineOptions",
    "InvalidParams",
    "KVCache",
    "MemoryPlan",
    "Model",
    "ModelConfig",
    "RequestOutput",
    "RequestStats",
    "RequestUpdate",
    "SamplingParams",
    "ServeConfig",
    "StepStats",
    "Tokenizer",
    "build_engine",
    "create_demo_checkpoint",
    "load_checkpoint_config",
    "load_model",
    "load_serve_config",
    "load_tokenizer",
    "plan_memory",
]
