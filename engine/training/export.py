"""The engine's parameters under the Hugging Face Qwen3-MoE names, the inverse of the loader."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.model import Model


def hf_state_dict(model: Model, dtype: torch.dtype) -> dict[str, Tensor]:
    """Per-expert `mlp.experts.{e}.*_proj.weight` names, as SDAR / Qwen3-MoE checkpoints
    on the Hub store them; contiguous CPU copies in `dtype` (what safetensors writes)."""
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.moe_intermediate_size

    def out(t: Tensor) -> Tensor:
        return t.detach().to(device="cpu", dtype=dtype).contiguous().clone()

    state: dict[str, Tensor] = {"model.embed_tokens.weight": out(model.embed.weight)}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.attn
        state[p + "input_layernorm.weight"] = out(layer.attn_norm.weight)
        state[p + "post_attention_layernorm.weight"] = out(layer.mlp_norm.weight)
        wq, wk, wv = attn.wqkv.weight.split((q, kv, kv), dim=0)
        state[p + "self_attn.q_proj.weight"] = out(wq)
        state[p + "self_attn.k_proj.weight"] = out(wk)
        state[p + "self_attn.v_proj.weight"] = out(wv)
        state[p + "self_attn.o_proj.weight"] = out(attn.wo.weight)
        state[p + "self_attn.q_norm.weight"] = out(attn.q_norm.weight)
        state[p + "self_attn.k_norm.weight"] = out(attn.k_norm.weight)
        mlp = layer.mlp
        if not cfg.is_moe_layer(i):
            raise ValueError("the demo model is MoE in every layer")
        state[p + "mlp.gate.weight"] = out(mlp.router)
        for e in range(cfg.num_experts):
            x = f"{p}mlp.experts.{e}."
            state[x + "gate_proj.weight"] = out(mlp.w_gate_up[e, :inter])
            state[x + "up_proj.weight"] = out(mlp.w_gate_up[e, inter:])
            state[x + "down_proj.weight"] = out(mlp.w_down[e])
    state["model.norm.weight"] = out(model.norm.weight)
    state["lm_head.weight"] = out(model.lm_head.weight)
    return state
