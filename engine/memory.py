"""How much device memory a model needs: weights, KV cache and activations.

Importable without torch, so the CLI and the agent can say whether a checkpoint fits a host's
GPUs before anything is loaded. An MoE model holds every expert, however few are active.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.config import ModelConfig

# Accepted spellings -> canonical name.
_DTYPE_NAMES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Hidden-size tensors alive at once per token at the peak (residual, normed input, attention
# output, MLP output, grouped copies for the experts), a deliberately generous count.
_ACTIVATION_COPIES = 6


def canonical_dtype(dtype: Any) -> str:
    """'fp32' | 'bf16' | 'fp16' for a dtype string or torch.dtype; ValueError naming the choices."""
    name = _DTYPE_NAMES.get(str(dtype).lower())
    if name is None:
        raise ValueError(
            f"dtype {dtype!r} is not supported; use one of fp32, bf16, fp16 "
            "(or float32, bfloat16, float16)"
        )
    return name


@dataclass
class MemoryPlan:
    """Bytes a model needs on its device, by kind."""

    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    total_bytes: int
    kv_bytes_per_token: int

    def to_dict(self) -> dict[str, int]:
        """Plain dict (for JSON and the CLI)."""
        return asdict(self)


def plan_memory(config: ModelConfig, dtype: Any, max_batch: int, max_seq: int) -> MemoryPlan:
    """Memory for `max_batch` sequences of up to `max_seq` tokens in `dtype`.

    Activations are the peak of one forward: a full-length prefill of one sequence (hidden
    states, q/k/v, MLP or expert intermediates, fp32 attention scores of one layer) or a
    denoising step of the whole batch, plus fp32 logits of the batch's sampled rows.
    """
    if max_batch < 1 or max_seq < 1:
        raise ValueError(f"max_batch and max_seq must be positive, got {max_batch}, {max_seq}")
    width = DTYPE_BYTES[canonical_dtype(dtype)]
    weights = config.num_parameters() * width
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * width
    kv_cache = kv_per_token * max_batch * max_seq

    h = config.hidden_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    mlp = max(
        2 * config.intermediate_size,
        2 * config.moe_intermediate_size * max(config.num_experts_per_tok, 1),
    )
    per_token = (_ACTIVATION_COPIES * h + qkv + mlp) * width
    prefill_tokens = max_seq
    step_tokens = max_batch * max(config.block_size, 1)
    tokens = max(prefill_tokens, step_tokens)
    # Attention scores of one layer, fp32, for the larger of the two shapes.
    scores = 4 * config.num_heads * max(max_seq * max_seq, step_tokens * max_seq)
    logits = 4 * config.vocab_size * step_tokens
    activations = per_token * tokens + scores + logits
    return MemoryPlan(
        weights_bytes=weights,
        kv_cache_bytes=kv_cache,
        activation_bytes=activations,
        total_bytes=weights + kv_cache + activations,
        kv_bytes_per_token=kv_per_token,
    )


def resident_dtype(
    stored: str,
    compute: str,
    policy: str,
    widened_bytes: int,
    budget_bytes: int | None,
) -> str:
    """The dtype weights are kept in: STORED, or COMPUTE (the activations' dtype) when they
    differ and POLICY says so ("compute"), or for "auto" when the widened model (WIDENED_BYTES,
    weights and KV cache) fits BUDGET_BYTES (None: unknown, keep them as stored)."""
    if stored == compute or policy == "stored":
        return stored
    if policy == "compute":
        return compute
    return compute if budget_bytes is not None and widened_bytes <= budget_bytes else stored
