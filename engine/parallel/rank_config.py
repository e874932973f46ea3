"""A rank's config: the model's config with the heads and intermediate sizes of its share.

Each rank builds the family's own model class from it (with its `DistributedShard`), so the
modules, the K/V stores (`KVCache`, `EncoderKV`) and their sizes follow the share unchanged.
Everything the engine core reads (vocabulary, token ids, block size, layers, experts) stays
the model's: the vocabulary rows and experts a rank holds are its shard's business.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from engine.config import ModelConfig
from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.parallel.plan import RankShare

AnyConfig = TypeVar("AnyConfig", ModelConfig, DiffusionGemmaConfig)


def rank_config(config: AnyConfig, share: RankShare) -> AnyConfig:
    """CONFIG as SHARE's rank holds it (the plan was checked against CONFIG first)."""
    heads = share.even(config.num_heads).count
    inter = share.even(config.intermediate_size).count
    moe_inter = share.expert_columns(config.moe_intermediate_size).count
    if isinstance(config, ModelConfig):
        return replace(
            config,
            num_heads=heads,
            num_kv_heads=share.kv_heads(config.num_kv_heads).count,
            intermediate_size=inter,
            moe_intermediate_size=moe_inter,
            notes=[],  # the checkpoint's notes were logged once, with the whole config
        )
    return replace(
        config,
        num_heads=heads,
        num_kv_heads=tuple(share.kv_heads(kv).count for kv in config.num_kv_heads),
        intermediate_size=inter,
        moe_intermediate_size=moe_inter,
    )
