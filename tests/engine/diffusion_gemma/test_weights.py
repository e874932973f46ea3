"""Loading DiffusionGemma checkpoints: the names a checkpoint may use, and one CheckpointError
naming every problem when its tensors or config do not fit."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import CheckpointError
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.families.diffusion_gemma.weights import DECODER, ENCODER
from engine.loader import load_model
from tests.engine.diffusion_gemma.checkpoints import TINY_VOCAB


@pytest.fixture
def copy_of_base(dg_checkpoint: Callable[[str], Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(dg_checkpoint("base"), tmp_path / "ckpt"))


def rewrite(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Applies EDIT to the checkpoint's tensors and writes them back."""
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def logits_of(model: DiffusionGemmaModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, TINY_VOCAB, (1, 7), generator=gen)
    canvas = torch.randint(0, TINY_VOCAB, (1, 8), generator=gen)
    return model.denoise(model.encode(prompt), canvas)


def test_load_model_returns_the_family_model_and_skips_the_vision_tower(
    dg_checkpoint: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.families.diffusion_gemma.weights"):
        model = load_model(dg_checkpoint("base"), dtype=torch.float32)
    assert isinstance(model, DiffusionGemmaModel)
    assert model.config.has_vision_tower
    assert "vision tensors not loaded" in caplog.text
    assert model.dtype == model.compute_dtype == torch.float32
    assert model.weight_bytes() == sum(
        t.numel() * 4 for t in (*model.parameters(), model.encoder_scalars, model.decoder_scalars)
    )


def test_tied_weights_may_come_under_the_encoders_names(
    dg_checkpoint: Callable[[str], Path], copy_of_base: Path
) -> None:
    """An exporter that wrote the encoder's copy of the tied weights (and not the decoder's)
    gives the same model."""

    def to_encoder_names(tensors: dict[str, torch.Tensor]) -> None:
        for name in list(tensors):
            tied = name.startswith(DECODER) and "self_conditioning" not in name
            if tied and not name.endswith("layer_scalar"):
                tensors[ENCODER + name.removeprefix(DECODER)] = tensors.pop(name)

    rewrite(copy_of_base, to_encoder_names)
    original = load_model(dg_checkpoint("base"), dtype=torch.float32)
    renamed = load_model(copy_of_base, dtype=torch.float32)
    assert isinstance(original, DiffusionGemmaModel) and isinstance(renamed, DiffusionGemmaModel)
    assert torch.equal(logits_of(original), logits_of(renamed))


def test_missing_and_mis_shaped_tensors_are_reported_together(copy_of_base: Path) -> None:
    def damage(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[f"{DECODER}layers.1.mlp.up_proj.weight"]
        del tensors[f"{ENCODER}layers.2.layer_scalar"]
        tensors[f"{DECODER}layers.0.self_attn.k_proj.weight"] = torch.zeros(15, 32)
        # A tied weight's second copy must fit too.
        tensors[f"{ENCODER}layers.3.mlp.down_proj.weight"] = torch.zeros(32, 47)
        tensors[f"{DECODER}layers.0.self_attn.extra.weight"] = torch.zeros(2)

    rewrite(copy_of_base, damage)
    with pytest.raises(CheckpointError) as caught:
        load_model(copy_of_base, dtype=torch.float32)
    message = str(caught.value)
    assert str(copy_of_base) in message
    assert f"missing tensors: {DECODER}layers.1.mlp.up_proj.weight" in message
    assert f"{ENCODER}layers.2.layer_scalar" in message
    assert f"{DECODER}layers.0.self_attn.k_proj.weight [15, 32] (expected [16, 32])" in message
    assert f"{ENCODER}layers.3.mlp.down_proj.weight [32, 47] (expected [32, 48])" in message
    assert f"unexpected tensors: {DECODER}layers.0.self_attn.extra.weight" in message


def test_a_bad_config_field_is_named_with_its_file(copy_of_base: Path) -> None:
    config_file = copy_of_base / "config.json"
    config = json.loads(config_file.read_text())
    config["text_config"]["top_k_experts"] = 9
    config_file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"text_config\.top_k_experts") as caught:
        load_model(copy_of_base, dtype=torch.float32)
    assert str(config_file) in str(caught.value)
