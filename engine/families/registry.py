"""Which family a checkpoint belongs to, and what it needs, from its config files alone.

Torch-free: `dctl model register` and the agent size a checkpoint before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import SUPPORTED_TYPES, ModelConfig, read_checkpoint_json
from engine.errors import CheckpointError
from engine.memory import MemoryPlan, canonical_dtype
from engine.memory import plan_memory as plan_sdar_memory

DIFFUSION_GEMMA_TYPES = ("diffusion_gemma",)
# family name (as `--family` spells it) -> the config.json model_type values it serves
FAMILY_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "sdar": SUPPORTED_TYPES,
    "diffusion-gemma": DIFFUSION_GEMMA_TYPES,
}


def family_of(config: dict[str, Any], *, source: str) -> str:
    """The family serving a `config.json` dict; CheckpointError naming the supported types."""
    model_type = config.get("model_type")
    for family, types in FAMILY_MODEL_TYPES.items():
        if model_type in types:
            return family
    known = ", ".join(t for types in FAMILY_MODEL_TYPES.values() for t in types)
    raise CheckpointError(
        f"{source}: field 'model_type' is {model_type!r}; the engine serves {known}"
    )


@dataclass(frozen=True)
class CheckpointSizing:
    """What a checkpoint needs, read from its config files."""

    family: str
    dtype: str  # the stored dtype ('bf16' when the config names none)
    plan: MemoryPlan
    num_parameters: int
    max_context_tokens: int
    # What the ranks of a parallel instance split (engine config `parallel`): query heads, each
    # distinct per-layer K/V head count, routed experts per MoE layer (0: dense), vocabulary.
    num_heads: int
    num_kv_heads: tuple[int, ...]
    num_experts: int
    vocab_size: int


def size_checkpoint(directory: Path, *, max_batch: int, max_seq: int) -> CheckpointSizing:
    """The memory plan of DIRECTORY's checkpoint for MAX_BATCH sequences of MAX_SEQ tokens
    (capped at its context); CheckpointError / ValueError say what is wrong with it."""
    source = str(directory / "config.json")
    raw = read_checkpoint_json(directory / "config.json")
    gen_file = directory / "generation_config.json"
    gen = read_checkpoint_json(gen_file) if gen_file.is_file() else None
    family = family_of(raw, source=source)
    if family == "diffusion-gemma":
        from engine.families.diffusion_gemma import memory as dg_memory
        from engine.families.diffusion_gemma.config import DiffusionGemmaConfig

        dg = DiffusionGemmaConfig.from_hf(raw, gen, source=source)
        dtype = canonical_dtype(dg.torch_dtype or "bf16")
        seq = min(dg.max_position_embeddings, max_seq)
        return CheckpointSizing(
            family=family,
            dtype=dtype,
            plan=dg_memory.plan_memory(dg, dtype, max_batch, seq),
            num_parameters=dg_memory.num_parameters(dg),
            max_context_tokens=dg.max_position_embeddings,
            num_heads=dg.num_heads,
            num_kv_heads=tuple(sorted(set(dg.num_kv_heads))),
            num_experts=dg.num_experts,
            vocab_size=dg.vocab_size,
        )
    config = ModelConfig.from_hf(raw, gen, source=source)
    dtype = canonical_dtype(config.torch_dtype or "bf16")
    seq = min(config.max_position_embeddings, max_seq)
    return CheckpointSizing(
        family=family,
        dtype=dtype,
        plan=plan_sdar_memory(config, dtype, max_batch, seq),
        num_parameters=config.num_parameters(),
        max_context_tokens=config.max_position_embeddings,
        num_heads=config.num_heads,
        num_kv_heads=(config.num_kv_heads,),
        num_experts=config.num_experts,
        vocab_size=config.vocab_size,
    )
