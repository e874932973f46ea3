"""DiffusionGemma's decoding settings: the checkpoint's `generation_config.json`, else the
reference's defaults; bad values name the file and the field; per-request overrides checked."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
)

from engine.errors import CheckpointError, InvalidParams
from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding

SOURCE = "/ckpt/generation_config.json"


def read(gen: dict[str, Any] | None, **kwargs: Any) -> DiffusionGemmaDecoding:
    return DiffusionGemmaDecoding.from_generation_config(
        gen, canvas_length=256, source=SOURCE, **kwargs
    )


def test_defaults_are_the_references() -> None:
    reference = DiffusionGemmaGenerationConfig._get_default_generation_params()
    got = read(None)
    assert got.max_new_tokens == reference["max_new_tokens"]
    assert got.max_denoising_steps == reference["max_denoising_steps"]
    assert got.entropy_bound == reference["sampler_config"].entropy_bound
    assert got.t_min == reference["t_min"]
    assert got.t_max == reference["t_max"]
    assert got.stability_threshold == reference["stability_threshold"]
    assert got.confidence_threshold == reference["confidence_threshold"]
    assert got.canvas_length == 256
    assert got.eos_token_ids == ()
    assert got.pad_token_id is None


def test_reads_a_generation_config_the_reference_writes() -> None:
    written = DiffusionGemmaGenerationConfig(
        max_new_tokens=512,
        max_denoising_steps=32,
        t_min=0.1,
        t_max=1.2,
        stability_threshold=3,
        confidence_threshold=0.02,
        eos_token_id=[1, 106],
        pad_token_id=0,
    )
    gen = written.to_dict()
    gen["sampler_config"] = {"entropy_bound": 0.25, "_cls_name": "EntropyBoundSamplerConfig"}
    got = read(gen)
    assert got == DiffusionGemmaDecoding(
        canvas_length=256,
        max_new_tokens=512,
        max_denoising_steps=32,
        entropy_bound=0.25,
        t_min=0.1,
        t_max=1.2,
        stability_threshold=3,
        confidence_threshold=0.02,
        eos_token_ids=(1, 106),
        pad_token_id=0,
    )


def test_nulls_take_the_defaults_and_eos_pad_fall_back_to_config_json() -> None:
    got = read(
        {"t_min": None, "sampler_config": None, "eos_token_id": None},
        fallback_eos_token_ids=(1,),
        fallback_pad_token_id=0,
    )
    assert (got.t_min, got.entropy_bound) == (0.4, 0.1)
    assert (got.eos_token_ids, got.pad_token_id) == ((1,), 0)
    assert read({"eos_token_id": 106}, fallback_eos_token_ids=(1,)).eos_token_ids == (106,)
    assert read({"pad_token_id": None}, fallback_pad_token_id=0).pad_token_id is None


@pytest.mark.parametrize(
    ("gen", "field"),
    [
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"max_denoising_steps": 2.5}, "max_denoising_steps"),
        ({"max_denoising_steps": True}, "max_denoising_steps"),
        ({"t_min": -0.1}, "t_min"),
        ({"t_min": 0.9}, "t_max"),  # t_max (0.8) must exceed it
        ({"t_max": "hot"}, "t_max"),
        ({"sampler_config": {"entropy_bound": 0}}, "sampler_config.entropy_bound"),
        ({"sampler_config": {"_cls_name": "OtherSampler"}}, "sampler_config._cls_name"),
        ({"sampler_config": 0.1}, "sampler_config"),
        ({"stability_threshold": -1}, "stability_threshold"),
        ({"confidence_threshold": 0.0}, "confidence_threshold"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"eos_token_id": "eos"}, "eos_token_id"),
        ({"eos_token_id": [1, -2]}, "eos_token_id"),
        ({"pad_token_id": 1.5}, "pad_token_id"),
    ],
)
def test_a_bad_value_names_the_file_and_the_field(gen: dict[str, Any], field: str) -> None:
    with pytest.raises(CheckpointError) as err:
        read(gen)
    assert SOURCE in str(err.value)
    assert f"'{field}'" in str(err.value)


def test_a_bad_canvas_length_is_a_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="canvas_length"):
        DiffusionGemmaDecoding.from_generation_config(None, canvas_length=0, source=SOURCE)


def test_overrides_apply_per_request_and_none_keeps_the_default() -> None:
    base = read(None)
    got = base.with_overrides(max_denoising_steps=12, t_max=1.5, entropy_bound=1, t_min=None)
    assert (got.max_denoising_steps, got.t_max, got.entropy_bound) == (12, 1.5, 1.0)
    assert isinstance(got.entropy_bound, float)
    assert got.t_min == base.t_min
    assert base.max_denoising_steps == 48  # the checkpoint's defaults are untouched
    assert base.with_overrides(eos_token_ids=7).eos_token_ids == (7,)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"entropy_bound": -1.0}, "entropy_bound"),
        ({"t_min": 0.8}, "t_min"),  # only t_min given: it is the one out of range
        ({"t_max": 0.3}, "t_max"),
        ({"t_min": 0.5, "t_max": 0.5}, "t_max"),
        ({"confidence_threshold": float("nan")}, "confidence_threshold"),
        ({"stability_threshold": 1.5}, "stability_threshold"),
    ],
)
def test_a_bad_override_is_invalid_params_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidParams) as err:
        read(None).with_overrides(**overrides)
    assert err.value.field == field


def test_the_canvas_is_not_a_per_request_setting() -> None:
    with pytest.raises(TypeError, match="canvas_length"):
        read(None).with_overrides(canvas_length=16)


def test_imports_without_torch() -> None:
    """The settings are read where torch is absent (the CLI and the agent read checkpoints)."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding\n"
        "print(DiffusionGemmaDecoding(canvas_length=4).max_denoising_steps)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "48"
