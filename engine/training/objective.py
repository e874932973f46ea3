"""The block-diffusion training objective, on the engine's own layers.

We follow the vectorised block-diffusion training of BD3-LM (Arriola et al., 2025, "Block
Diffusion: Interpolating Between Autoregressive and Diffusion Language Models") as SDAR (Cheng et
al., 2025) and LLaDA2.0 use it: a sequence of L tokens in blocks of B is fed twice, as
[noisy copy | clean copy] (2L wide, both at positions 0..L-1), under one attention mask:

- a clean token attends to clean tokens of its own and earlier blocks (block-causal): these are
  the keys and values the engine's cache holds for committed blocks;
- a noisy token attends to the noisy tokens of its own block and the clean tokens of earlier
  blocks: what a denoising step of the engine sees (the block being unmasked plus the cache).

Each block of each row gets its own mask ratio t ~ U(0, 1]; every token of the block is replaced
by the mask token with probability t (at least one per block). The loss is the cross-entropy of
the masked positions of the noisy copy, averaged over them. LLaDA weights each token by 1/t
(an ELBO); we keep the plain average, the lower-variance choice the small-model block-diffusion
recipes use, since the demo optimises for decoding behaviour, not likelihood bounds.

The MoE layers add the Switch-Transformer load-balancing loss (Fedus et al., 2021) so that every
expert gets work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model import Model, MoE, _Step, project, rotary_tables

MIN_MASK_RATIO = 1e-3


def training_mask(length: int, block: int, device: torch.device | None = None) -> Tensor:
    """Boolean (2L, 2L) attention mask for [noisy | clean], True where a query may attend."""
    blocks = torch.arange(length, device=device) // block
    q, k = blocks.view(-1, 1), blocks.view(1, -1)
    noisy_noisy = q == k
    noisy_clean = k < q
    clean_clean = k <= q
    clean_noisy = torch.zeros_like(noisy_noisy)
    top = torch.cat((noisy_noisy, noisy_clean), dim=1)
    bottom = torch.cat((clean_noisy, clean_clean), dim=1)
    return torch.cat((top, bottom), dim=0)


def corrupt(
    ids: Tensor,
    block: int,
    mask_token_id: int,
    gen: torch.Generator,
    suffix_share: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """(noisy ids, masked) for clean ids (N, L): per block a ratio t ~ U(0, 1], each token
    masked with probability t, at least one per block.

    With `suffix_share` > 0, that share of the blocks instead masks a suffix: every position
    from a uniformly drawn k in [0, B) on. Threshold decoding mostly unmasks from the left, so
    "clean prefix, masked rest" is the state the engine meets most; uniform masks alone spend
    most targets on gaps with right context that decoding never has. (The ratio is still random
    per block: (B - k) / B.)
    """
    n, length = ids.shape
    nblocks = length // block
    ratio = torch.rand(n, nblocks, 1, generator=gen).clamp(min=MIN_MASK_RATIO)
    draws = torch.rand(n, nblocks, block, generator=gen)
    masked = draws < ratio
    # The lowest draw of each block is always masked, so no block is left without a target.
    lowest = draws.argmin(dim=-1, keepdim=True)
    masked.scatter_(-1, lowest, True)
    if suffix_share > 0:
        # Drawn only when asked, so the held-out masks of evaluations stay what they were.
        use_suffix = torch.rand(n, nblocks, 1, generator=gen) < suffix_share
        first = torch.randint(0, block, (n, nblocks, 1), generator=gen)
        suffix = torch.arange(block).view(1, 1, block) >= first
        masked = torch.where(use_suffix, suffix, masked)
    masked = masked.view(n, length)
    return torch.where(masked, torch.full_like(ids, mask_token_id), ids), masked


def moe_forward(moe: MoE, x: Tensor) -> tuple[Tensor, Tensor]:
    """The engine's MoE (same routing, same weights) in a differentiable form, and the
    load-balancing loss E * sum_e f_e * P_e (f: share of routed tokens, P: mean probability)."""
    s, k = x.shape[0], moe.top_k
    probs = F.linear(x, moe.router).softmax(dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.view(-1)
    counts = torch.bincount(flat, minlength=moe.num_experts)
    order = flat.argsort(stable=True)
    grouped = x[order // k]
    outs, start = [], 0
    for e, c in enumerate(counts.tolist()):
        if c == 0:
            continue
        gate, up = (grouped[start : start + c] @ moe.w_gate_up[e].t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ moe.w_down[e].t())
        start += c
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_choice = torch.cat(outs)[inverse].view(s, k, -1)
    out = (per_choice * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
    share = counts.to(torch.float32) / (s * k)
    balance = moe.num_experts * (share * probs.mean(dim=0)).sum()
    return out, balance


@dataclass(frozen=True)
class Losses:
    """One batch's losses: the diffusion loss, the balance loss, and how many targets."""

    diffusion: Tensor
    balance: Tensor
    targets: int


def block_diffusion_loss(
    model: Model, clean: Tensor, noisy: Tensor, masked: Tensor, block: int
) -> Losses:
    """Cross-entropy on the masked positions of `noisy`, given clean earlier blocks."""
    logits, balance = _forward(model, clean, noisy, masked, block)
    loss = F.cross_entropy(logits, clean[masked])
    return Losses(loss, balance, int(masked.sum()))


def _forward(
    model: Model, clean: Tensor, noisy: Tensor, masked: Tensor, block: int
) -> tuple[Tensor, Tensor]:
    if model.packed_scope == "all":
        # The objective runs the experts itself, on the stacked expert weights packing emptied.
        raise ValueError("a model with packed expert weights is for inference only")
    n, length = clean.shape
    dev = model.device
    ids = torch.cat((noisy, clean), dim=1)
    positions = torch.arange(length, device=dev).repeat(2).expand(n, 2 * length)
    cos, sin = rotary_tables(positions, model.inv_freq, model.dtype)
    mask = training_mask(length, block, dev).view(1, 1, 2 * length, 2 * length)
    ctx = _Step(cos, sin, mask, positions, None, None, 0, False, None)
    x = model.embed(ids)
    balance = x.new_zeros(())
    for layer in model.layers:
        x = x + layer.attn(layer.attn_norm(x), ctx, layer.index)
        flat = x.view(-1, x.shape[-1])
        h = layer.mlp_norm(flat)
        if isinstance(layer.mlp, MoE):
            out, layer_balance = moe_forward(layer.mlp, h)
            balance = balance + layer_balance
        else:
            out = layer.mlp(h)
        x = (flat + out).view(n, 2 * length, -1)
    rows = x[:, :length][masked]
    logits = project(model.norm(rows), model.lm_head.weight).float()
    return logits, balance / len(model.layers)


def masked_logits(model: Model, clean: Tensor, noisy: Tensor, masked: Tensor, block: int) -> Tensor:
    """Logits (targets, vocab) of the masked positions, as the loss sees them."""
    return _forward(model, clean, noisy, masked, block)[0]
