"""plan_memory: the figures dctl and the agent use to decide whether a model fits a host."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.memory import canonical_dtype, plan_memory
from tests.engine.published_configs import qwen3_moe


def test_weights_bytes_equal_the_loaded_model(tiny_checkpoint: Path) -> None:
    for dtype in ("fp32", "bf16"):
        model = load_model(tiny_checkpoint, dtype=dtype)
        actual = sum(p.numel() * p.element_size() for p in model.parameters())
        assert plan_memory(model.config, dtype, 1, 16).weights_bytes == actual


def test_tied_head_is_counted_once(tmp_path: Path) -> None:
    from tests.engine.conftest import build_tiny_checkpoint

    path = build_tiny_checkpoint(
        tmp_path / "tied", config_overrides={"tie_word_embeddings": True}, with_tokenizer=False
    )
    model = load_model(path)
    actual = sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan_memory(model.config, torch.float32, 1, 16).weights_bytes == actual


def test_kv_cache_bytes_equal_a_real_cache(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    cache = KVCache(model.config, num_slots=3, max_seq_len=40, dtype=torch.bfloat16)
    plan = plan_memory(model.config, "bfloat16", max_batch=3, max_seq=40)
    assert plan.kv_cache_bytes == cache.bytes_total
    assert plan.kv_bytes_per_token == cache.bytes_per_token
    assert cache.bytes_total == sum(t.numel() * t.element_size() for t in cache.keys + cache.values)


def test_an_moe_model_holds_all_its_experts() -> None:
    """Qwen3-30B-A3B in bf16: ~61 GB of weights although ~3B parameters are active."""
    cfg = ModelConfig.from_hf(qwen3_moe())
    plan = plan_memory(cfg, "bf16", max_batch=16, max_seq=4096)
    assert plan.weights_bytes == pytest.approx(61.06e9, rel=3e-3)
    # 48 layers x 4 kv heads x 128 x 2 (k, v) x 2 bytes = 96 KiB per token.
    assert plan.kv_bytes_per_token == 98304
    assert plan.kv_cache_bytes == 98304 * 16 * 4096
    assert plan.total_bytes == plan.weights_bytes + plan.kv_cache_bytes + plan.activation_bytes
    assert 0 < plan.activation_bytes < plan.weights_bytes
    assert plan.to_dict()["total_bytes"] == plan.total_bytes


def test_memory_grows_with_batch_sequence_and_dtype() -> None:
    cfg = ModelConfig.from_hf(qwen3_moe())
    small = plan_memory(cfg, "bf16", 1, 1024)
    assert plan_memory(cfg, "bf16", 8, 1024).kv_cache_bytes == 8 * small.kv_cache_bytes
    assert plan_memory(cfg, "bf16", 1, 4096).activation_bytes > small.activation_bytes
    assert plan_memory(cfg, "fp32", 1, 1024).weights_bytes == 2 * small.weights_bytes


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("fp32", "fp32"),
        ("float32", "fp32"),
        ("BF16", "bf16"),
        ("bfloat16", "bf16"),
        ("float16", "fp16"),
        (torch.bfloat16, "bf16"),
        (torch.float16, "fp16"),
    ],
)
def test_dtype_spellings(given: object, expected: str) -> None:
    assert canonical_dtype(given) == expected


def test_bad_arguments_are_explained() -> None:
    cfg = ModelConfig.from_hf(qwen3_moe())
    with pytest.raises(ValueError, match="dtype 'int4' is not supported; use one of fp32, bf16"):
        plan_memory(cfg, "int4", 1, 1)
    with pytest.raises(ValueError, match="must be positive"):
        plan_memory(cfg, "bf16", 0, 1)
