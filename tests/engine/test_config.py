"""ModelConfig.from_hf: the config.json spellings real checkpoints use, defaults, and errors."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from engine.config import SDAR_DEFAULT_MASK_TOKEN_ID, ModelConfig
from engine.errors import CheckpointError
from tests.engine.published_configs import qwen3_moe


def test_reads_a_qwen3_moe_config() -> None:
    cfg = ModelConfig.from_hf(qwen3_moe())
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (48, 32, 4, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert cfg.rope_theta == 1e6 and cfg.norm_topk_prob and cfg.torch_dtype == "bfloat16"
    assert all(cfg.is_moe_layer(i) for i in range(48))
    assert cfg.eos_token_ids == [151645]
    assert not cfg.can_diffuse and cfg.block_size == 1


def test_parameter_count_of_qwen3_30b_a3b() -> None:
    """30.5B parameters in total (the published figure), every expert included."""
    assert ModelConfig.from_hf(qwen3_moe()).num_parameters() == pytest.approx(30.53e9, rel=2e-3)


def test_transformers5_spellings() -> None:
    """transformers 5 writes num_local_experts and rope_parameters and dtype."""
    raw = qwen3_moe(dtype="float32", rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    raw["num_local_experts"] = raw.pop("num_experts")
    del raw["rope_theta"], raw["torch_dtype"]
    cfg = ModelConfig.from_hf(raw)
    assert cfg.num_experts == 128 and cfg.rope_theta == 5e5 and cfg.torch_dtype == "float32"


def test_linear_rope_scaling_and_unsupported_kinds() -> None:
    cfg = ModelConfig.from_hf(qwen3_moe(rope_scaling={"type": "linear", "factor": 2.0}))
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 2.0)
    with pytest.raises(CheckpointError, match=r"rope_scaling\.rope_type.*'yarn'"):
        ModelConfig.from_hf(qwen3_moe(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_sparse_step_and_mlp_only_layers() -> None:
    cfg = ModelConfig.from_hf(
        qwen3_moe(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    )
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_dense_qwen3_has_no_experts_and_head_dim_default() -> None:
    raw = {
        "model_type": "qwen3",
        "vocab_size": 1000,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    cfg = ModelConfig.from_hf(raw)
    assert cfg.num_experts == 0 and not cfg.is_moe
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 128  # HF Qwen3 defaults


def test_mask_token_lookup_order(caplog: pytest.LogCaptureFixture) -> None:
    sdar = qwen3_moe(model_type="sdar_moe")
    assert (
        ModelConfig.from_hf({**sdar, "mask_token_id": 7}, {"mask_token_id": 8}, 9).mask_token_id
        == 7
    )
    assert ModelConfig.from_hf(sdar, {"mask_token_id": 8}, 9).mask_token_id == 8
    assert ModelConfig.from_hf(sdar, {}, 9).mask_token_id == 9
    caplog.clear()
    cfg = ModelConfig.from_hf(sdar)
    assert cfg.mask_token_id == SDAR_DEFAULT_MASK_TOKEN_ID and cfg.block_size == 4
    assert "using the SDAR default 151669" in caplog.text
    assert "using the SDAR default 4" in caplog.text


def test_block_size_lookup() -> None:
    assert ModelConfig.from_hf(qwen3_moe(block_length=8), None, 5).block_size == 8
    assert ModelConfig.from_hf(qwen3_moe(), {"block_size": 16}, 5).block_size == 16
    # Diffusion-capable but silent about the block: 4; not diffusion-capable: plain causal.
    assert ModelConfig.from_hf(qwen3_moe(), None, 5).block_size == 4
    with pytest.raises(CheckpointError, match="'block_size' must be at least 1"):
        ModelConfig.from_hf(qwen3_moe(block_size=0), None, 5)


def test_eos_ids_merge_config_and_generation_config() -> None:
    cfg = ModelConfig.from_hf(qwen3_moe(), {"eos_token_id": [151645, 151643]})
    assert cfg.eos_token_ids == [151645, 151643]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"model_type": "mixtral"}, "'model_type' is 'mixtral'"),
        ({"model_type": None}, "'model_type' is None"),
        ({"num_attention_heads": None}, "'num_attention_heads' is required but missing"),
        ({"hidden_size": "2048"}, "'hidden_size' must be a non-negative integer"),
        ({"num_key_value_heads": 5}, r"'num_key_value_heads' \(5\) must divide"),
        ({"num_experts_per_tok": 200}, r"'num_experts_per_tok' \(200\) exceeds"),
        ({"hidden_act": "gelu"}, "'hidden_act' is 'gelu'"),
        ({"use_sliding_window": True}, "'use_sliding_window' is true"),
        ({"mask_token_id": 999999}, "'mask_token_id' .* outside the vocabulary"),
        ({"mlp_only_layers": "all"}, "'mlp_only_layers' must be a list"),
    ],
)
def test_bad_configs_name_file_field_and_supported_types(
    overrides: dict[str, Any], expected: str
) -> None:
    with pytest.raises(CheckpointError, match=expected) as err:
        ModelConfig.from_hf(qwen3_moe(**overrides), source="/ckpt/config.json")
    assert str(err.value).startswith("/ckpt/config.json: field ")
    assert "supported model_type values: qwen3_moe, sdar_moe, qwen3, sdar" in str(err.value)


def test_config_and_memory_import_without_torch() -> None:
    """The CLI and the agent size checkpoints on machines where torch is absent."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import engine, engine.config, engine.memory\n"
        "from engine import ModelConfig, plan_memory, CheckpointError\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
