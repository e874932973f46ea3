"""Where a CPU has no native bf16 matmuls, the engine keeps weights widened to fp32 when the
memory allows (or the config says so), instead of widening every weight on every forward."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ModelConfig
from engine.factory import EngineOptions, cpu_weights_dtype
from engine.memory import resident_dtype

GIB = 1 << 30


def test_the_rule() -> None:
    # Native support (or fp32 weights): nothing to widen, whatever the policy.
    assert resident_dtype("bf16", "bf16", "compute", GIB, 4 * GIB) == "bf16"
    assert resident_dtype("fp32", "fp32", "auto", GIB, 4 * GIB) == "fp32"
    assert resident_dtype("bf16", "fp32", "stored", GIB, 4 * GIB) == "bf16"
    assert resident_dtype("bf16", "fp32", "compute", 8 * GIB, 4 * GIB) == "fp32"
    # auto: widened only when the widened model fits the budget, and never on an unknown one.
    assert resident_dtype("bf16", "fp32", "auto", GIB, 4 * GIB) == "fp32"
    assert resident_dtype("bf16", "fp32", "auto", 8 * GIB, 4 * GIB) == "bf16"
    assert resident_dtype("bf16", "fp32", "auto", GIB, None) == "bf16"


def _config() -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2,
        },
        None,
        tokenizer_mask_token_id=63,
        source="test",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("native", "policy", "fraction", "loaded"),
    [
        (False, "auto", 0.85, "fp32"),  # no native bf16, fits: widened once at load
        (False, "auto", 1e-12, "bf16"),  # does not fit the RAM budget: widened per matmul
        (False, "stored", 0.85, "bf16"),
        (True, "auto", 0.85, "bf16"),  # native bf16: computed in bf16, nothing to widen
    ],
)
def test_the_server_loads_weights_in_the_dtype_the_cpu_computes_fastest(
    native: bool, policy: Any, fraction: float, loaded: str
) -> None:
    options = EngineOptions(
        max_batch_size=4, max_seq_len=512, resident_weights=policy, memory_fraction=fraction
    )
    assert cpu_weights_dtype(_config(), "bf16", options, native=native) == loaded


def test_without_a_memory_budget_auto_keeps_the_weights_as_stored() -> None:
    # The library's default (no memory_fraction): RAM is not the engine's to fill.
    options = EngineOptions(max_batch_size=4, max_seq_len=512, resident_weights="auto")
    assert cpu_weights_dtype(_config(), "bf16", options, native=False) == "bf16"
