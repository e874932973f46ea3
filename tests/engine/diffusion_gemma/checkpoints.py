"""Tiny random DiffusionGemma checkpoints, written by transformers' own classes.

`build_checkpoint(path, ...)` saves a `DiffusionGemmaForBlockDiffusion` with `save_pretrained`
(the layout a user's download has: decoder names for the tied text weights, both stacks'
`layer_scalar` buffers, a vision tower) and returns the directory. The vision tower is one
16-wide layer (the default one is 168 M parameters). Every weight is drawn at a scale that
makes the logits spread (norm weights and layer scalars around 1, each stack's scalars its
own), so a wrong rule shows in the logits rather than hiding under a near-uniform output.

`TINY_TEXT` is the default text config: 4 layers, sliding (window 4) and full attention
alternating, 4 query heads over 2 K/V heads of 8 (sliding) and 1 of 16 (full), 4 experts top-2
beside the dense MLP, vocabulary of 96.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TINY_VOCAB = 96
TINY_TEXT: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "global_head_dim": 16,
    "num_global_key_value_heads": 1,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 16,
    "max_position_embeddings": 512,
    "eos_token_id": 1,
    "pad_token_id": 0,
}
TINY_VISION: dict[str, Any] = {
    "model_type": "gemma4_vision",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """The text config arguments of a tiny checkpoint (override any of them)."""
    return {**TINY_TEXT, **overrides}


def reference_config(
    text: dict[str, Any] | None = None, *, canvas_length: int = 8, **top: Any
) -> Any:
    """transformers' DiffusionGemmaConfig for TEXT (default `TINY_TEXT`) with the tiny tower."""
    from transformers import DiffusionGemmaConfig

    return DiffusionGemmaConfig(
        text_config=dict(text or TINY_TEXT),
        vision_config=dict(TINY_VISION),
        canvas_length=canvas_length,
        **top,
    )


def randomize(model: Any, seed: int) -> None:
    """Draws every weight of a transformers DiffusionGemma model so that the logits spread."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1:
                # Norm weights, router scales, per-expert scales: around 1, not all 1.
                param.copy_(1.0 + 0.3 * noise)
            else:
                fan_in = param.shape[-1]
                scale = 1.0 if "embed_tokens" in name else 1.5 / math.sqrt(fan_in)
                param.copy_(noise * scale)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(1.0 + 0.2 * torch.randn(buffer.shape, generator=gen))


def build_checkpoint(
    path: Path,
    *,
    text: dict[str, Any] | None = None,
    canvas_length: int = 8,
    seed: int = 0,
    generation_config: dict[str, Any] | None = None,
    **top: Any,
) -> Path:
    """Writes a random tiny checkpoint at PATH and returns PATH. TEXT: the text config
    (`tiny_text_config(...)`); TOP: top-level config arguments (e.g. tie_word_embeddings)."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(
        reference_config(text, canvas_length=canvas_length, **top)
    )
    randomize(model, seed)
    model.save_pretrained(path)
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return path


def load_reference(path: Path) -> Any:
    """transformers' model of a checkpoint directory, fp32, in eval mode."""
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
    return model.eval()


# Named checkpoints the tests share (built once per session by conftest's `dg_checkpoints`):
# name -> build_checkpoint arguments.
VARIANTS: dict[str, dict[str, Any]] = {
    # Sliding/full alternating, GQA 2:1 (sliding) and 4:1 (full, head 16), canvas 8.
    "base": {},
    # Canvas 16, a soft-cap that bites (logits reach ~18 uncapped), 3 layers
    # (sliding, sliding, full), a window of 6, proportional rope on half the full heads.
    "canvas16": {
        "canvas_length": 16,
        "seed": 1,
        "text": tiny_text_config(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            sliding_window=6,
            final_logit_softcapping=3.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.5,
                    "rope_theta": 1_000_000.0,
                },
            },
        ),
    },
    # Top-level tie_word_embeddings false: a separate encoder stack and LM head.
    "untied": {"seed": 2, "tie_word_embeddings": False},
    # use_bidirectional_attention "all": a bidirectional encoder (the reference fails on it).
    "bidirectional": {
        "seed": 3,
        "text": tiny_text_config(use_bidirectional_attention="all", sliding_window=4),
    },
}
