"""An SDAR-family rank: its `Model` built from its config and shard, loaded from its slices.

Which slices (each parameter of the whole model, as `engine.loader` names it):
- `embed.weight`, `lm_head.weight`: the rank's vocabulary rows;
- `attn.wqkv` (q, k, v rows fused): the rank's query heads' rows of q_proj and its K/V heads'
  rows of k_proj / v_proj, in the same fused order; `attn.wo`: the columns of its query heads
  (its bias, which must be added once, on rank 0 only);
- dense `mlp.w_gate_up` / `mlp.w_down`: the rank's intermediate rows / columns;
- experts (per expert or stacked): the rank's experts whole, or its columns of every expert;
- norms and the router: whole.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.loader import _Target, check_sdar_checkpoint
from engine.model import Model
from engine.parallel.collectives import DistributedShard
from engine.parallel.plan import RankShare
from engine.parallel.rank_config import rank_config
from engine.parallel.slices import LoadedShard, SliceRead, SliceRules, read_slices

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def load_sdar_shard(
    path: str | Path,
    share: RankShare,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> LoadedShard:
    """SHARE's rank of the checkpoint at PATH: its `Model` (rank config, `DistributedShard`)
    with its slices loaded, the whole config, and what was read. The plan is checked against the
    model first (ParallelPlanError); the checkpoint as `load_sdar_model` checks it
    (CheckpointError)."""
    checked = check_sdar_checkpoint(path, dtype)
    cfg = checked.config
    share.plan.check(cfg)
    model = Model(
        rank_config(cfg, share),
        dtype=checked.dtype,
        device="meta",
        compute_dtype=compute_dtype,
        shard=DistributedShard(share, cfg.vocab_size),
    )
    model.materialize(device)
    rules = _SdarRules(share, cfg)
    reads = [r for name, target in checked.chosen.items() for r in rules.reads(name, target)]
    log = read_slices(reads, checked.headers, dict(model.named_parameters()))
    model.eval()
    return LoadedShard(model, cfg, log)


class _SdarRules(SliceRules):
    """The slices of each SDAR parameter (module docstring)."""

    def __init__(self, share: RankShare, cfg: ModelConfig) -> None:
        super().__init__(share)
        self.cfg = cfg
        d = cfg.head_dim
        self.heads = share.even(cfg.num_heads).scaled(d)
        self.kv = share.kv_heads(cfg.num_kv_heads).scaled(d)
        self.inter = share.even(cfg.intermediate_size)
        self.experts = share.experts(cfg.num_experts)
        self.expert_cols = share.expert_columns(cfg.moe_intermediate_size)

    def reads(self, name: str, target: _Target) -> list[SliceRead]:
        """The reads of checkpoint tensor NAME, which fills TARGET of the whole model."""
        param = target.param
        if param in ("embed.weight", "lm_head.weight"):
            return self.vocab(name, target, self.cfg.vocab_size)
        if param.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
            return self._qkv(name, target)
        if param.endswith("attn.wo.weight"):
            return self.columns(name, target, self.heads)
        if param.endswith("attn.wo.bias"):
            # Row-parallel: each rank's output is partial and summed; the bias is added once.
            if self.share.rank == 0:
                return self.whole(name, target)
            return [SliceRead(name, (), param, (), zero=True)]
        if param.endswith("mlp.w_gate_up.weight"):
            half = 0 if target.index[0].start == 0 else 1
            n = self.inter.count
            return self.rows(name, target, self.inter, (slice(half * n, (half + 1) * n),))
        if param.endswith("mlp.w_down.weight"):
            return self.columns(name, target, self.inter)
        if param.endswith(("mlp.w_gate_up", "mlp.w_down")):
            return self._experts(name, target)
        return self.whole(name, target)

    def _qkv(self, name: str, target: _Target) -> list[SliceRead]:
        q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        ql, kvl = self.heads.count, self.kv.count
        start = target.index[0].start
        if start == 0:
            return self.rows(name, target, self.heads, (slice(0, ql),))
        dest = slice(ql, ql + kvl) if start == q else slice(ql + kvl, ql + 2 * kvl)
        if start not in (q, q + kv):
            raise RuntimeError(f"{name}: no q, k or v span starts at row {start}")
        return self.rows(name, target, self.kv, (dest,))

    def _experts(self, name: str, target: _Target) -> list[SliceRead]:
        inter = self.cfg.moe_intermediate_size
        if not target.index:  # stacked: every expert in one tensor
            if target.param.endswith("w_gate_up"):
                return self.stacked_gate_up(name, target, inter)
            return self.stacked_down(name, target, inter)
        found = _EXPERT.search(name)
        expert = int(found.group(1)) if found else -1
        if not self.experts.start <= expert < self.experts.stop:
            return []  # another rank's expert
        local = expert - self.experts.start
        cols = self.expert_cols
        if target.param.endswith("w_down"):
            source = (slice(None), slice(cols.start, cols.stop))
            return [SliceRead(name, source, target.param, (local,))]
        half = 0 if target.index[1].start == 0 else 1
        dest = (local, slice(half * cols.count, (half + 1) * cols.count))
        return [SliceRead(name, (slice(cols.start, cols.stop),), target.param, dest)]
