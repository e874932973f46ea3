"""config.json files as their models publish them, for tests that check figures against the
published ones (parameter counts, memory) without any weights."""

from __future__ import annotations

from typing import Any


def qwen3_moe(**overrides: Any) -> dict[str, Any]:
    """A Qwen3-30B-A3B-shaped config.json (as published), with overrides."""
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config
