"""Tiny real checkpoints for the engine tests, built once per session.

`build_tiny_checkpoint(path, ...)` writes a Hugging Face checkpoint directory the way a user's
download looks: a random `transformers` Qwen3-MoE (or Qwen3) model saved with `save_pretrained`
(per-expert tensor names, optionally sharded), a `generation_config.json`, and the demo
checkpoint's byte-level BPE tokenizer (`engine.demo_checkpoint.write_tokenizer`: `tokenizer.json`
plus `tokenizer_config.json` with a Qwen3-style chat template honouring `enable_thinking`).

Fixtures (session scope, shared by every engine test module):
- `tiny_checkpoint`: qwen3_moe, fp32, 2 layers, 8 experts top-2, `block_size` 4 in config.json,
  the mask token known only through the tokenizer's `<|mask|>` special token.
- `tiny_checkpoint_config`: the transformers config dict it was built from.

Token facts tests can rely on: ids 0..3 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`,
`<|mask|>`; EOS ids are [<|im_end|>, <|endoftext|>]; the tokenizer defines fewer ids
(TOKENIZER_VOCAB) than the model's vocab_size (TINY_VOCAB), like real Qwen checkpoints whose
embedding has padding rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine import demo_checkpoint
from engine.demo_checkpoint import CHAT_TEMPLATE

ENDOFTEXT_ID, IM_START_ID, IM_END_ID, MASK_ID = 0, 1, 2, 3  # demo_checkpoint.SPECIAL_TOKENS
TINY_VOCAB = 320  # model embedding rows; the tokenizer defines at most TOKENIZER_VOCAB ids
TOKENIZER_VOCAB = 300  # 298 BPE ids (special tokens included) + the two thinking markers
MOE_ONLY_KEYS = ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size")


def tiny_hf_config(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments of a tiny Qwen3MoeConfig (override any of them)."""
    config: dict[str, Any] = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "eos_token_id": IM_END_ID,
    }
    config.update(overrides)
    return config


def write_tokenizer(path: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """The demo checkpoint's tokenizer (the project's one way to make it), TOKENIZER_VOCAB ids."""
    demo_checkpoint.write_tokenizer(
        path,
        vocab_size=TOKENIZER_VOCAB - len(demo_checkpoint.THINK_TOKENS),
        chat_template=chat_template,
    )


def build_tiny_checkpoint(
    path: Path,
    *,
    dense: bool = False,
    model_type: str | None = None,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    config_overrides: dict[str, Any] | None = None,
    extra_config: dict[str, Any] | None = None,
    with_tokenizer: bool = True,
    chat_template: str | None = CHAT_TEMPLATE,
) -> Path:
    """Writes a random tiny checkpoint directory at `path` and returns it.

    dense: a Qwen3ForCausalLM instead of Qwen3-MoE. model_type: rewrite config.json's model_type
    afterwards (e.g. "sdar_moe"). max_shard_size: e.g. "20KB" for a sharded checkpoint.
    config_overrides: arguments of the transformers config. extra_config: keys merged into
    config.json after saving (default {"block_size": 4}).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    kwargs = tiny_hf_config(**(config_overrides or {}))
    if dense:
        for key in MOE_ONLY_KEYS:
            kwargs.pop(key, None)
        model: Any = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**kwargs))
    model = model.to(getattr(torch, dtype))
    save_kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    config = json.loads((path / "config.json").read_text())
    config.update({"block_size": 4} if extra_config is None else extra_config)
    if model_type is not None:
        config["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if with_tokenizer:
        write_tokenizer(path, chat_template=chat_template)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_moe checkpoint directory with tokenizer (see the module docstring)."""
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt") / "tiny-moe")


@pytest.fixture(scope="session")
def tiny_checkpoint_config() -> dict[str, Any]:
    """The transformers config arguments `tiny_checkpoint` was built from."""
    return tiny_hf_config()
