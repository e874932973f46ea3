"""The memory plan of a DiffusionGemma checkpoint, read from its config files alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import DiffusionGemmaForBlockDiffusion

from cli.cmd_model import memory_plan
from engine.errors import CheckpointError
from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo
from engine.families.diffusion_gemma.memory import kv_bytes_per_token, num_parameters
from engine.families.diffusion_gemma.memory import plan_memory as plan_dg
from engine.families.registry import family_of, size_checkpoint


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_diffusion_gemma_demo(tmp_path_factory.mktemp("dg") / "demo")


def config_of(directory: Path) -> DiffusionGemmaConfig:
    raw = json.loads((directory / "config.json").read_text())
    return DiffusionGemmaConfig.from_hf(raw, None, source=str(directory / "config.json"))


def test_parameters_are_the_text_model_counted_once(demo: Path) -> None:
    # The reference's decoder holds every text weight (the encoder's are tied to it) and the
    # self-conditioning MLP; the vision tower is not loaded by the engine.
    reference = DiffusionGemmaForBlockDiffusion.from_pretrained(demo)
    text = sum(p.numel() for p in reference.model.decoder.parameters())
    everything = sum(p.numel() for p in reference.parameters())
    assert num_parameters(config_of(demo)) == text < everything


def test_kv_per_token_sums_sliding_and_full_layers_of_the_encoder_only(demo: Path) -> None:
    cfg = config_of(demo)
    sliding = [i for i in range(cfg.num_layers) if cfg.is_sliding(i)]
    assert sliding and len(sliding) < cfg.num_layers  # both kinds, of different shapes
    assert len({(cfg.num_kv_heads[i], cfg.head_dims[i]) for i in range(cfg.num_layers)}) == 2
    expected = sum(2 * k * d * 2 for k, d in zip(cfg.num_kv_heads, cfg.head_dims, strict=True))
    assert kv_bytes_per_token(cfg, 2) == expected


def test_more_running_requests_need_more_canvas_memory(demo: Path) -> None:
    cfg = config_of(demo)
    one, sixteen = plan_dg(cfg, "bf16", 1, 256), plan_dg(cfg, "bf16", 16, 256)
    assert one.weights_bytes == sixteen.weights_bytes == num_parameters(cfg) * 2
    assert sixteen.kv_cache_bytes == 16 * one.kv_cache_bytes
    # Each running canvas carries fp32 canvas x vocab tensors (logits, probabilities, and the
    # previous step's logits for self-conditioning).
    assert sixteen.activation_bytes - one.activation_bytes >= 15 * 3 * 4 * 512 * cfg.canvas_length


def test_registration_sizes_a_diffusion_gemma_checkpoint_by_its_family(demo: Path) -> None:
    plan, note = memory_plan(demo)
    assert plan is not None, note
    assert plan.num_parameters == num_parameters(config_of(demo))
    assert plan.kv_bytes_per_token == kv_bytes_per_token(config_of(demo), 4)  # stored in fp32
    assert plan.dtype == "fp32" and "memory plan (fp32)" in note
    assert size_checkpoint(demo, max_batch=1, max_seq=64).family == "diffusion-gemma"


def test_an_unknown_model_type_names_the_types_served() -> None:
    with pytest.raises(CheckpointError, match=r"'model_type' is 'llama'.*diffusion_gemma"):
        family_of({"model_type": "llama"}, source="config.json")
