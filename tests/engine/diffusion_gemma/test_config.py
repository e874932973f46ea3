"""DiffusionGemmaConfig: what a config.json says, the reference's defaults for what it leaves
out (held to transformers' own config classes), and a CheckpointError naming the field and the
file for what it gets wrong."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from typing import Any

import pytest

from engine.errors import CheckpointError
from engine.families.diffusion_gemma.config import FULL, SLIDING, DiffusionGemmaConfig
from tests.engine.diffusion_gemma.checkpoints import TINY_TEXT, reference_config

SOURCE = "/ckpt/config.json"


def ours(config: dict[str, Any], generation: dict[str, Any] | None = None) -> DiffusionGemmaConfig:
    return DiffusionGemmaConfig.from_hf(config, generation, source=SOURCE)


def saved(**text: Any) -> dict[str, Any]:
    """config.json as save_pretrained writes it for the tiny text config with TEXT changed."""
    return dict(reference_config({**TINY_TEXT, **text}).to_dict())


def test_a_saved_config_reads_back() -> None:
    config = ours(saved())
    assert config.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert config.head_dims == (8, 16, 8, 16)
    assert config.num_kv_heads == (2, 1, 2, 1)
    assert (config.sliding_window, config.sliding_context) == (4, 3)
    assert (config.num_experts, config.top_k_experts, config.moe_intermediate_size) == (4, 2, 16)
    assert config.canvas_length == 8 and config.tie_word_embeddings
    assert config.final_logit_softcapping == 30.0
    assert config.has_vision_tower and config.image_token_id == 258_880
    assert config.eos_token_ids == (1,) and config.pad_token_id == 0
    assert config.decoding.eos_token_ids == (1,) and config.decoding.canvas_length == 8
    assert config.rope[FULL].rope_type == "proportional"
    assert config.kv_capacities(100) == (3, 100, 3, 100)


@pytest.mark.parametrize(
    "text",
    [
        # No layer_types, per_layer_config, rope or window: all the reference's defaults.
        {"num_hidden_layers": 7, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8},
        # Gemma 4's spelling of the full-attention heads, and a last layer declared sliding.
        {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "top_k_experts": 1,
            "moe_intermediate_size": 8,
            "global_head_dim": 64,
            "num_global_key_value_heads": 2,
            "layer_types": [SLIDING, FULL, SLIDING],
            "use_bidirectional_attention": "all",
            "sliding_window": 9,
        },
    ],
    ids=["defaults", "global-heads"],
)
def test_missing_fields_take_the_references_defaults(text: dict[str, Any]) -> None:
    from transformers import DiffusionGemmaTextConfig

    reference = DiffusionGemmaTextConfig(**copy.deepcopy(text))
    config = ours({"model_type": "diffusion_gemma", "text_config": copy.deepcopy(text)})
    n = reference.num_hidden_layers
    assert config.layer_types == tuple(reference.layer_types)
    assert config.head_dims == tuple(reference.per_layer_config[i].head_dim for i in range(n))
    assert config.num_kv_heads == tuple(
        reference.per_layer_config[i].num_key_value_heads for i in range(n)
    )
    for kind, rope in config.rope.items():
        expected = reference.rope_parameters[kind]
        assert rope.rope_type == expected["rope_type"]
        assert rope.theta == expected["rope_theta"]
        assert rope.partial_rotary_factor == expected.get("partial_rotary_factor", 1.0)
    # The reference halves a bidirectional window (plus one) at load; its sliding cache layers
    # keep one position less than that: what our sliding layers keep.
    assert config.sliding_context == reference.sliding_window - 1
    assert config.final_logit_softcapping == reference.final_logit_softcapping
    assert (config.vocab_size, config.hidden_size) == (reference.vocab_size, reference.hidden_size)
    assert config.canvas_length == 256 and not config.has_vision_tower


def broken(field: str, value: Any) -> dict[str, Any]:
    """The saved tiny config with one dotted FIELD set to VALUE (deleted when VALUE is ...)."""
    config = saved()
    *parents, leaf = field.split(".")
    target = config
    for key in parents:
        target = target[key]
    if value is ...:
        del target[leaf]
    else:
        target[leaf] = value
    return config


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("model_type", "gemma4", "model_type"),
        ("text_config", ..., "text_config"),
        ("canvas_length", 0, "canvas_length"),
        ("text_config.layer_types", [SLIDING, FULL], "text_config.layer_types"),
        ("text_config.layer_types", [SLIDING, "local", SLIDING, FULL], "text_config.layer_types"),
        ("text_config.num_key_value_heads", 3, "text_config.num_key_value_heads"),
        ("text_config.num_experts", ..., "text_config.num_experts"),
        ("text_config.top_k_experts", 5, "text_config.top_k_experts"),
        ("text_config.sliding_window", 1, "text_config.sliding_window"),
        ("text_config.hidden_activation", "silu", "text_config.hidden_activation"),
        ("text_config.attention_bias", True, "text_config.attention_bias"),
        (
            "text_config.use_bidirectional_attention",
            "text",
            "text_config.use_bidirectional_attention",
        ),
        ("text_config.final_logit_softcapping", -1, "text_config.final_logit_softcapping"),
        (
            "text_config.per_layer_config",
            {"1": {"intermediate_size": 64}},
            "text_config.per_layer_config.1.intermediate_size",
        ),
        ("text_config.per_layer_config", {"9": {"head_dim": 8}}, "text_config.per_layer_config.9"),
        (
            "text_config.rope_parameters.full_attention.rope_type",
            "yarn",
            "text_config.rope_parameters.full_attention.rope_type",
        ),
        (
            "text_config.rope_parameters.sliding_attention",
            ...,
            "text_config.rope_parameters.sliding_attention",
        ),
    ],
)
def test_a_bad_field_is_named_with_the_file(field: str, value: Any, named: str) -> None:
    with pytest.raises(CheckpointError, match=re.escape(f"'{named}'")) as caught:
        ours(broken(field, value))
    assert str(caught.value).startswith(SOURCE)


def test_a_bad_generation_config_names_its_own_file() -> None:
    with pytest.raises(CheckpointError) as caught:
        ours(saved(), {"t_min": 0.9, "t_max": 0.5})
    assert str(caught.value).startswith("/ckpt/generation_config.json")


def test_the_config_module_does_not_need_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\nimport engine.families.diffusion_gemma.config\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
