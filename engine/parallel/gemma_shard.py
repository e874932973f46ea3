"""A DiffusionGemma rank: its `DiffusionGemmaModel` built from its config and shard, loaded from
its slices.

Which slices (each parameter of the whole model, as `engine.families.diffusion_gemma.weights`
names it; the encoder's own stack, when untied, like the decoder's):
- `embed.weight`, `encoder_embed.weight`, `lm_head`: the rank's vocabulary rows;
- `attn.q_proj`: its query heads' rows; `attn.k_proj` / `attn.v_proj`: its K/V heads' rows (of
  that layer's head size and K/V head count); `attn.o_proj`: its query heads' columns;
- `mlp.gate` / `mlp.up` and the self-conditioning MLP's: its intermediate rows; their `down`:
  its intermediate columns;
- `experts.gate_up` / `experts.down` (stacked): its experts whole, or its columns of each;
- norms, router, router and expert scales, layer scalars: whole.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.families.diffusion_gemma.weights import check_checkpoint
from engine.loader import _Target
from engine.parallel.collectives import DistributedShard
from engine.parallel.plan import RankShare
from engine.parallel.rank_config import rank_config
from engine.parallel.slices import LoadedShard, SliceRead, SliceRules, read_slices

_LAYER = re.compile(r"layers\.(\d+)\.")
_MLP_IN = ("mlp.gate.weight", "mlp.up.weight", "self_cond.gate.weight", "self_cond.up.weight")
_MLP_OUT = ("mlp.down.weight", "self_cond.down.weight")


def load_gemma_shard(
    path: str | Path,
    share: RankShare,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> LoadedShard:
    """SHARE's rank of the DiffusionGemma checkpoint at PATH: its `DiffusionGemmaModel` (rank
    config, `DistributedShard`) with its slices loaded, the whole config, and what was read.
    The plan is checked against the model first (ParallelPlanError); the checkpoint as
    `load_diffusion_gemma` checks it."""
    checked = check_checkpoint(path, dtype)
    cfg = checked.config
    share.plan.check(cfg)
    model = DiffusionGemmaModel(
        rank_config(cfg, share),
        dtype=checked.dtype,
        device="meta",
        compute_dtype=compute_dtype,
        shard=DistributedShard(share, cfg.vocab_size),
    )
    model.materialize(device)
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    params = {n: p for n, p in params.items() if not n.startswith("inv_freq")}
    rules = _GemmaRules(share, cfg)
    reads = [r for name, target in checked.chosen.items() for r in rules.reads(name, target)]
    log = read_slices(reads, checked.headers, params)
    model.eval()
    return LoadedShard(model, cfg, log)


class _GemmaRules(SliceRules):
    """The slices of each DiffusionGemma parameter (module docstring)."""

    def __init__(self, share: RankShare, cfg: DiffusionGemmaConfig) -> None:
        super().__init__(share)
        self.cfg = cfg
        self.inter = share.even(cfg.intermediate_size)

    def reads(self, name: str, target: _Target) -> list[SliceRead]:
        """The reads of checkpoint tensor NAME, which fills TARGET of the whole model."""
        param, cfg, share = target.param, self.cfg, self.share
        if param in ("embed.weight", "encoder_embed.weight", "lm_head"):
            return self.vocab(name, target, cfg.vocab_size)
        if param.endswith(_MLP_IN):
            return self.rows(name, target, self.inter)
        if param.endswith(_MLP_OUT):
            return self.columns(name, target, self.inter)
        if param.endswith("experts.gate_up"):
            return self.stacked_gate_up(name, target, cfg.moe_intermediate_size)
        if param.endswith("experts.down"):
            return self.stacked_down(name, target, cfg.moe_intermediate_size)
        found = _LAYER.search(param)
        if found is None or ".attn." not in param or param.endswith(("q_norm", "k_norm")):
            return self.whole(name, target)
        layer = int(found.group(1))
        d = cfg.head_dims[layer]
        heads = share.even(cfg.num_heads).scaled(d)
        if param.endswith("attn.q_proj.weight"):
            return self.rows(name, target, heads)
        if param.endswith("attn.o_proj.weight"):
            return self.columns(name, target, heads)
        # k_proj, v_proj
        return self.rows(name, target, share.kv_heads(cfg.num_kv_heads[layer]).scaled(d))
