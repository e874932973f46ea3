"""DiffusionGemma's transformer layer (Gemma 4 style), shared by the encoder and the decoder.

A layer: pre-norm attention with a post-norm; then a GELU MLP and routed experts side by side
on the same residual, each with its own norms, summed, normed once more and added back. The
layer's output is scaled by a per-layer scalar that the encoder and the decoder hold apart
(the reference ties every weight of the two stacks except that buffer), so it is an argument.

Attention has no 1/sqrt(d) scaling (q and k are RMS-normed instead); values are RMS-normed
without a weight; full-attention layers have no v projection: their values are the raw k
projection, normed.

A layer may be one rank's share (`engine.model.ModelShard`): its config holds the rank's heads
and intermediate sizes, its experts are the shard's, and the partial outputs of the attention,
the MLP and the experts are summed over the shards before their norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.model import WHOLE_MODEL, ModelShard, project, rotate


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """Gemma's RMSNorm: normalised and scaled in fp32, then back to x's dtype."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(x.dtype)


def activation(name: str, x: Tensor) -> Tensor:
    """The MLPs' activation: GELU with the tanh approximation (the reference's default) or exact."""
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def _vector(dim: int, *, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.ones(dim, dtype=dtype, device=device))


class Attention(nn.Module):
    """GQA attention of one layer; its head size and K/V heads depend on the layer type."""

    def __init__(
        self, cfg: DiffusionGemmaConfig, layer: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads[layer]
        self.head_dim = d = cfg.head_dims[layer]
        kw = {"dtype": dtype, "device": device}
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False, **kw)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False, **kw)
        self.v_proj = (
            nn.Linear(h, self.num_kv_heads * d, bias=False, **kw) if cfg.is_sliding(layer) else None
        )
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False, **kw)
        self.q_norm = _vector(d, **kw)
        self.k_norm = _vector(d, **kw)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated, normed keys and normed values of x (N, T, hidden), each (N, kv, T, d)."""
        n, t, _ = x.shape
        raw_k = project(x, self.k_proj.weight).view(n, t, -1, self.head_dim)
        raw_v = (
            raw_k
            if self.v_proj is None
            else project(x, self.v_proj.weight).view(n, t, -1, self.head_dim)
        )
        k = rotate(rms_norm(raw_k, self.k_norm, self.eps), cos, sin)
        v = rms_norm(raw_v, None, self.eps)
        return k.transpose(1, 2), v.transpose(1, 2)

    def queries(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotated, normed queries of x (N, T, hidden): (N, heads, T, d)."""
        n, t, _ = x.shape
        q = project(x, self.q_proj.weight).view(n, t, -1, self.head_dim)
        return rotate(rms_norm(q, self.q_norm, self.eps), cos, sin).transpose(1, 2)

    def attend(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
        """Attention output (N, T, hidden) of queries over keys/values under an additive mask."""
        n, _, t, _ = q.shape
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            scale=1.0,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return project(out.transpose(1, 2).reshape(n, t, -1), self.o_proj.weight)


class DenseMLP(nn.Module):
    """The gated GELU MLP: down(act(gate(x)) * up(x))."""

    def __init__(
        self, hidden: int, inter: int, act: str, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.act = act
        self.gate = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., hidden) -> (..., hidden)."""
        gated = activation(self.act, project(x, self.gate.weight)) * project(x, self.up.weight)
        return project(gated, self.down.weight)


class Experts(nn.Module):
    """Routed experts: a softmax top-k router over the (unnormed) residual, weights renormalised
    and scaled per expert; each expert a gated GELU MLP, computed grouped by expert. Only the
    shard's experts are held and computed: the output is their part of the mix."""

    def __init__(
        self,
        cfg: DiffusionGemmaConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        shard: ModelShard = WHOLE_MODEL,
    ):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = {"dtype": dtype, "device": device}
        self.num_experts, self.top_k = e, cfg.top_k_experts
        self.first_expert, self.local_experts = shard.experts(e)
        self.eps, self.act = cfg.rms_norm_eps, cfg.hidden_activation
        self.router = nn.Parameter(torch.empty(e, h, **kw))
        self.router_scale = _vector(h, **kw)
        self.expert_scale = _vector(e, **kw)
        self.gate_up = nn.Parameter(torch.empty(self.local_experts, 2 * i, h, **kw))
        self.down = nn.Parameter(torch.empty(self.local_experts, h, i, **kw))

    def forward(self, route_from: Tensor, x: Tensor) -> Tensor:
        """Mixes the experts' outputs for x (S, hidden), routed by ROUTE_FROM (S, hidden)."""
        scaled = rms_norm(route_from, None, self.eps) * self.router_scale
        scores = project(scaled * route_from.shape[-1] ** -0.5, self.router)
        probs = scores.softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.expert_scale[experts].float()
        flat = experts.view(-1)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        order = flat.argsort(stable=True)
        # Rows grouped by expert: one pair of matmuls per active expert, not per token. A shard
        # takes the span of that order routed to its own experts (all of it when it holds all).
        first, last = self.first_expert, self.first_expert + self.local_experts
        skip = sum(counts[:first])
        rows = order[skip : skip + sum(counts[first:last])]
        grouped = x[rows // self.top_k]
        out = torch.empty_like(grouped)
        start = 0
        for e, count in enumerate(counts[first:last]):
            if count == 0:
                continue
            end = start + count
            gate, up = project(grouped[start:end], self.gate_up[e]).chunk(2, dim=-1)
            out[start:end] = project(activation(self.act, gate) * up, self.down[e])
            start = end
        # Back to (token, k) order and summed over k: deterministic, unlike a scatter-add.
        # Choices of experts held elsewhere add nothing here.
        if self.local_experts == self.num_experts:
            per_choice = torch.empty_like(out)
        else:
            per_choice = out.new_zeros(x.shape[0] * self.top_k, x.shape[-1])
        per_choice[rows] = out
        per_choice = per_choice.view(x.shape[0], self.top_k, -1) * weights.to(x.dtype)[..., None]
        return per_choice.sum(dim=1)


class Layer(nn.Module):
    """One transformer layer's weights and its feed-forward half; the attention half is run by
    the pass (encoder or decoder, `engine.families.diffusion_gemma.model`), which owns the keys
    and values the queries see."""

    def __init__(
        self,
        cfg: DiffusionGemmaConfig,
        index: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        shard: ModelShard = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        h, kw = cfg.hidden_size, {"dtype": dtype, "device": device}
        self.index, self.eps, self.shard = index, cfg.rms_norm_eps, shard
        self.attn = Attention(cfg, index, **kw)
        self.mlp = DenseMLP(h, cfg.intermediate_size, cfg.hidden_activation, **kw)
        self.experts = Experts(cfg, shard=shard, **kw)
        self.input_norm = _vector(h, **kw)
        self.post_attn_norm = _vector(h, **kw)
        self.pre_mlp_norm = _vector(h, **kw)
        self.post_mlp_norm = _vector(h, **kw)
        self.pre_experts_norm = _vector(h, **kw)
        self.post_experts_norm = _vector(h, **kw)
        self.post_ffn_norm = _vector(h, **kw)

    def feed_forward(self, x: Tensor, scalar: Tensor) -> Tensor:
        """The MLP and experts half, residual included, times the layer scalar."""
        shape, flat = x.shape, x.reshape(-1, x.shape[-1])
        dense = self.shard.reduce(self.mlp(rms_norm(flat, self.pre_mlp_norm, self.eps)))
        dense = rms_norm(dense, self.post_mlp_norm, self.eps)
        routed = self.experts(flat, rms_norm(flat, self.pre_experts_norm, self.eps))
        routed = rms_norm(self.shard.reduce(routed), self.post_experts_norm, self.eps)
        out = flat + rms_norm(dense + routed, self.post_ffn_norm, self.eps)
        return (out * scalar.to(out.dtype)).view(shape)
