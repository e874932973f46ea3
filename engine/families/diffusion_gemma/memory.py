"""How much memory a DiffusionGemma model needs: weights once, the encoder's K/V, the canvas.

Torch-free, like `engine/memory.py` (the SDAR plan), so registration and the agent can size a
checkpoint before anything is loaded. What differs from SDAR:
- weights: the encoder and the decoder share every layer, the embedding and the final norm, so
  they count once; only the decoder's self-conditioning MLP is its own. Each layer holds a dense
  GELU MLP beside its routed experts. Full-attention layers have no V projection (their values
  are their normalised keys). A checkpoint's vision tower is not loaded, so it is not counted.
- K/V: only the encoder writes the cache (prompt and committed canvases); the decoder reads it
  and keeps its canvas's K/V for one forward. Sliding and full layers differ in head size and
  K/V heads, so the per-token figure sums the layers one by one. It counts sliding layers at
  every position, an upper bound: the engine keeps only their window (a ring per slot), but a
  per-token figure is what hosts multiply by their context, and over-asking is the safe side.
- activations: a denoising step runs `canvas_length` positions per request, and each running
  request carries its previous step's logits for self-conditioning (fp32, canvas x vocab), on top
  of the step's own logits and probabilities.
"""

from __future__ import annotations

from typing import Any

from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.memory import DTYPE_BYTES, MemoryPlan, canonical_dtype

# Hidden-size tensors alive at once per token at the peak, as generous as the SDAR plan's.
_ACTIVATION_COPIES = 6
# fp32 canvas x vocab tensors per request during a step: the new logits, their probabilities,
# and the previous step's logits kept for self-conditioning.
_VOCAB_TENSORS = 3


def num_parameters(config: DiffusionGemmaConfig) -> int:
    """Parameters the engine loads: the text model, encoder and decoder counted once."""
    h, heads, experts = config.hidden_size, config.num_heads, config.num_experts
    total = config.vocab_size * h  # the embedding (tied to the LM head)
    if not config.tie_word_embeddings:
        total += config.vocab_size * h
    for layer in range(config.num_layers):
        hd, kv = config.head_dims[layer], config.num_kv_heads[layer]
        values = kv * hd * h if config.is_sliding(layer) else 0
        total += heads * hd * h * 2 + kv * hd * h + values  # q, o, k, v
        total += 2 * hd  # q and k norms
        total += 3 * h * config.intermediate_size  # the dense MLP
        total += experts * 3 * h * config.moe_intermediate_size  # the routed experts
        total += h * experts + h + experts  # router, its scale, per-expert scales
        total += 7 * h  # the norms around attention, the dense MLP and the experts
    total += 3 * h * config.intermediate_size + h  # self-conditioning MLP and its norm
    return total + h  # the final norm


def kv_bytes_per_token(config: DiffusionGemmaConfig, width: int) -> int:
    """Bytes one encoded position takes over every layer (keys and values)."""
    layers = zip(config.num_kv_heads, config.head_dims, strict=True)
    return sum(2 * kv * hd * width for kv, hd in layers)


def plan_memory(
    config: DiffusionGemmaConfig, dtype: Any, max_batch: int, max_seq: int
) -> MemoryPlan:
    """Memory for MAX_BATCH requests of up to MAX_SEQ positions (prompt and canvases) in DTYPE.

    Activations are the peak of one forward: a whole-prompt encode of one request, or a
    denoising step of every running request's canvas, plus the fp32 canvas x vocab tensors.
    """
    if max_batch < 1 or max_seq < 1:
        raise ValueError(f"max_batch and max_seq must be positive, got {max_batch}, {max_seq}")
    width = DTYPE_BYTES[canonical_dtype(dtype)]
    weights = num_parameters(config) * width
    per_token_kv = kv_bytes_per_token(config, width)
    kv_cache = per_token_kv * max_batch * max_seq

    h = config.hidden_size
    layers = zip(config.num_kv_heads, config.head_dims, strict=True)
    widest = max((config.num_heads + 2 * kv) * hd for kv, hd in layers)
    mlp = 2 * max(config.intermediate_size, config.moe_intermediate_size * config.top_k_experts)
    per_token = (_ACTIVATION_COPIES * h + widest + mlp) * width
    canvas_tokens = max_batch * config.canvas_length
    tokens = max(max_seq, canvas_tokens)
    scores = 4 * config.num_heads * max(max_seq * max_seq, canvas_tokens * (max_seq))
    vocab = 4 * config.vocab_size * canvas_tokens * _VOCAB_TENSORS
    activations = per_token * tokens + scores + vocab
    return MemoryPlan(
        weights_bytes=weights,
        kv_cache_bytes=kv_cache,
        activation_bytes=activations,
        total_bytes=weights + kv_cache + activations,
        kv_bytes_per_token=per_token_kv,
    )
