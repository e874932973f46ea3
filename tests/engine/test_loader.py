"""Loading checkpoint directories: layouts, dtypes, and a clear CheckpointError for every defect."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.loader import load_checkpoint_config, load_model, load_tokenizer
from tests.engine.conftest import MASK_ID, build_tiny_checkpoint


@pytest.fixture
def ckpt(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))


def ids() -> torch.Tensor:
    return torch.arange(10).view(1, 10) * 7 % 300


def rewrite_weights(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Rewrites model.safetensors with tensors replaced (or removed, for None)."""
    tensors = load_file(path / "model.safetensors")
    for name, value in edit.items():
        if value is None:
            tensors.pop(name)
        else:
            tensors[name] = value
    save_file(tensors, path / "model.safetensors")


def test_stacked_expert_layout_loads_like_per_expert(ckpt: Path, tiny_checkpoint: Path) -> None:
    """transformers 5 in-memory layout (experts.gate_up_proj / down_proj) is accepted too."""
    tensors = load_file(ckpt / "model.safetensors")
    cfg = load_checkpoint_config(ckpt)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up, down = [], []
        for e in range(cfg.num_experts):
            gate = tensors.pop(f"{p}{e}.gate_proj.weight")
            up = tensors.pop(f"{p}{e}.up_proj.weight")
            gate_up.append(torch.cat((gate, up)))
            down.append(tensors.pop(f"{p}{e}.down_proj.weight"))
        tensors[p + "gate_up_proj"] = torch.stack(gate_up)
        tensors[p + "down_proj"] = torch.stack(down)
    save_file(tensors, ckpt / "model.safetensors")
    stacked = load_model(ckpt)(ids())
    per_expert = load_model(tiny_checkpoint)(ids())
    assert torch.equal(stacked, per_expert)


def test_checkpoint_dtype_is_honoured_unless_overridden(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16", with_tokenizer=False)
    assert load_model(path).dtype == torch.bfloat16
    fp32 = load_model(path, dtype="fp32")
    assert fp32.dtype == torch.float32
    assert load_model(path, dtype=torch.float16).dtype == torch.float16
    # Upcasting bf16 weights is exact: the fp32 model holds the very same values.
    bf16 = load_model(path)
    assert torch.equal(fp32.embed.weight, bf16.embed.weight.float())


def test_unsupported_dtype_request_is_a_checkpoint_error(tiny_checkpoint: Path) -> None:
    with pytest.raises(CheckpointError, match=r"int8.*fp32, bf16, fp16"):
        load_model(tiny_checkpoint, dtype="int8")


def test_config_reads_mask_from_tokenizer_and_eos_from_generation_config(
    tiny_checkpoint: Path,
) -> None:
    cfg = load_checkpoint_config(tiny_checkpoint)
    assert cfg.mask_token_id == MASK_ID
    assert cfg.can_diffuse
    assert cfg.block_size == 4
    assert cfg.eos_token_ids == [2, 0]


def test_truncated_safetensors_file(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated.*re-download"):
        load_model(ckpt)


def test_file_cut_inside_the_header(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated header"):
        load_model(ckpt)


def test_garbage_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        load_model(ckpt)


def test_missing_tensor_is_named(ckpt: Path) -> None:
    rewrite_weights(ckpt, {"model.layers.1.self_attn.k_norm.weight": None})
    with pytest.raises(
        CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm"
    ):
        load_model(ckpt)


def test_missing_expert_is_named_in_per_expert_form(ckpt: Path) -> None:
    rewrite_weights(ckpt, {"model.layers.0.mlp.experts.5.up_proj.weight": None})
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in str(err.value)
    assert "gate_proj" not in str(err.value)


def test_wrong_shape_is_named_with_both_shapes(ckpt: Path) -> None:
    rewrite_weights(ckpt, {"model.norm.weight": torch.ones(65)})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight \[65\] \(expected \[64\]\)"):
        load_model(ckpt)


def test_all_problems_are_reported_in_one_error(ckpt: Path) -> None:
    rewrite_weights(
        ckpt,
        {
            "model.layers.0.self_attn.q_proj.weight": None,
            "model.layers.1.mlp.gate.weight": torch.zeros(9, 64),
            "model.layers.7.extra.weight": torch.zeros(2),
        },
    )
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    message = str(err.value)
    assert "missing tensors: model.layers.0.self_attn.q_proj.weight" in message
    assert "unexpected tensors: model.layers.7.extra.weight" in message
    assert "model.layers.1.mlp.gate.weight [9, 64] (expected [8, 64])" in message


def test_integer_weights_are_rejected(ckpt: Path) -> None:
    rewrite_weights(ckpt, {"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=r"unsupported dtype.*model\.norm\.weight \(I32\)"):
        load_model(ckpt)


def test_unknown_model_type_names_file_field_and_supported_types(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        load_model(ckpt)
    message = str(err.value)
    assert "config.json" in message and "'model_type'" in message and "'llama'" in message
    assert "qwen3_moe, sdar_moe, qwen3, sdar" in message


def test_missing_required_field(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    del config["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'num_hidden_layers' is required but missing"):
        load_model(ckpt)


def test_unreadable_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: cannot read it as JSON"):
        load_model(ckpt)


def test_not_a_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_model(tmp_path)


def test_no_weight_files(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_model(ckpt)


def test_sharded_index_pointing_at_a_missing_shard(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "sharded", max_shard_size="40KB", with_tokenizer=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"{shard}: listed in model.safetensors.index.json"):
        load_model(path)


def test_sharded_index_listing_a_tensor_no_shard_holds(tmp_path: Path) -> None:
    path = build_tiny_checkpoint(tmp_path / "sharded", max_shard_size="40KB", with_tokenizer=False)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = next(iter(index["weight_map"].values()))
    index["weight_map"]["model.layers.0.ghost.weight"] = first
    index_file.write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"lists tensors no shard holds: model\.layers\.0\.ghost"
    ):
        load_model(path)


def test_unreadable_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: unreadable tokenizer"):
        load_tokenizer(ckpt)


def test_missing_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: missing"):
        load_tokenizer(ckpt)


def test_checkpoint_without_mask_token_loads_as_causal_lm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = build_tiny_checkpoint(tmp_path / "plain", with_tokenizer=False, extra_config={})
    model = load_model(path)
    assert not model.config.can_diffuse
    assert model.config.block_size == 1
    assert "cannot diffuse" in caplog.text
    assert model(ids()).shape == (1, 10, 320)
