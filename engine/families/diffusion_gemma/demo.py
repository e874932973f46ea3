"""A deterministic tiny DiffusionGemma checkpoint with random weights, for tests and demos.

The directory looks like a downloaded DiffusionGemma checkpoint, only small:
- `config.json`: `model_type` `diffusion_gemma`, written the way `transformers` serialises its
  `DiffusionGemmaConfig` (sorted keys, a nested `text_config` whose full-attention layers carry
  their own head size and KV-head count in `per_layer_config`, and a `vision_config`), but built
  here as plain JSON so writing it needs no `transformers`;
- `model.safetensors`: every tensor `DiffusionGemmaForBlockDiffusion` loads, under the names its
  `save_pretrained` writes: the text stack once, under `model.decoder` (the encoder's text layers
  are tied to it), the encoder's per-layer `layer_scalar` buffers, the tiny vision tower and its
  projection; the LM head is tied to the embedding and not stored;
- `generation_config.json`: the block-diffusion decoding fields (denoising steps, temperature
  schedule, entropy bound, stopping thresholds, special ids);
- `tokenizer.json` + `tokenizer_config.json`: the SDAR demo's byte-level BPE
  (`engine.demo_checkpoint.train_tokenizer`) with Gemma-style special tokens and chat template,
  filled up with `<unusedN>` tokens so the tokenizer defines exactly `vocab_size` ids.

The same seed gives byte-identical files, so a snapshot digest of the directory is stable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.demo_checkpoint import prepare_demo_directory, train_tokenizer

# Gemma's layout: pad, eos, bos first; the chat-turn and image markers after them. No mask
# token: DiffusionGemma's canvas starts as uniform noise, not masks.
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
TURN_START, TURN_END = "<|turn>", "<turn|>"
IMAGE_START, IMAGE_END, IMAGE = "<|image>", "<image|>", "<|image|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, TURN_START, TURN_END, IMAGE_START, IMAGE_END, IMAGE]

# Gemma 4 turns: `<|turn>ROLE\n...<turn|>\n`, the assistant speaking as `model`, the prompt opened
# by BOS. An image part becomes the image placeholder that a processor widens into soft tokens.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class DemoShape:
    """Architecture of the tiny demo: the text stack, then the vision tower."""

    vocab_size: int = 512
    bpe_vocab: int = 448  # the BPE trains up to this; `<unusedN>` tokens fill the rest
    hidden: int = 64
    intermediate: int = 128
    # Sliding layers between full ones, ending on a full layer as the format requires.
    layer_types: tuple[str, ...] = (
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    )
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    # Full-attention layers use wider heads and fewer KV heads, and no v_proj (keys are values).
    global_head_dim: int = 32
    global_kv_heads: int = 1
    sliding_window: int = 32  # twice the canvas, like the released model's 512 vs 256
    experts: int = 4
    experts_per_tok: int = 2
    moe_intermediate: int = 32
    canvas_length: int = 16
    max_positions: int = 2048
    final_logit_softcapping: float = 30.0
    vision_hidden: int = 32
    vision_intermediate: int = 64
    vision_layers: int = 1
    vision_heads: int = 2
    vision_head_dim: int = 16
    patch_size: int = 4
    position_embedding_size: int = 64
    pooling_kernel_size: int = 2

    @property
    def layers(self) -> int:
        """Number of text layers."""
        return len(self.layer_types)


TINY = DemoShape()


def checkpoint_config(shape: DemoShape, ids: dict[str, int]) -> dict[str, Any]:
    """The `config.json` dict, with the keys and values `transformers` writes for this shape."""
    full_layers = [i for i, kind in enumerate(shape.layer_types) if kind == "full_attention"]
    full_layer = {"head_dim": shape.global_head_dim, "num_key_value_heads": shape.global_kv_heads}
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "final_logit_softcapping": shape.final_logit_softcapping,
        "head_dim": shape.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": shape.hidden,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate,
        "layer_types": list(shape.layer_types),
        "max_position_embeddings": shape.max_positions,
        "model_type": "diffusion_gemma_text",
        "moe_intermediate_size": shape.moe_intermediate,
        "num_attention_heads": shape.heads,
        "num_experts": shape.experts,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "pad_token_id": ids[PAD],
        # transformers folds `global_head_dim` / `num_global_key_value_heads` into this on load
        # and writes only this form back.
        "per_layer_config": {str(i): dict(full_layer) for i in full_layers},
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": shape.sliding_window,
        "tie_word_embeddings": True,
        "top_k_experts": shape.experts_per_tok,
        # Image tokens attend to each other both ways in the encoder; text stays causal there.
        "use_bidirectional_attention": "vision",
        "vocab_size": shape.vocab_size,
    }
    vision = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": shape.vision_head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": shape.vision_hidden,
        "initializer_range": 0.02,
        "intermediate_size": shape.vision_intermediate,
        "max_position_embeddings": 131072,
        "model_type": "gemma4_vision",
        "num_attention_heads": shape.vision_heads,
        "num_hidden_layers": shape.vision_layers,
        "num_key_value_heads": shape.vision_heads,
        "patch_size": shape.patch_size,
        "pooling_kernel_size": shape.pooling_kernel_size,
        "position_embedding_size": shape.position_embedding_size,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"},
        "standardize": False,
        "use_clipped_linears": False,
    }
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "boi_token_id": ids[IMAGE_START],
        "canvas_length": shape.canvas_length,
        "dtype": "float32",
        "eoi_token_id": ids[IMAGE_END],
        "image_token_id": ids[IMAGE],
        "initializer_range": 0.02,
        "model_type": "diffusion_gemma",
        "text_config": text,
        "tie_word_embeddings": True,
        "vision_config": vision,
    }


def generation_config(ids: dict[str, int]) -> dict[str, Any]:
    """The `generation_config.json` dict: the reference decoding defaults, fewer steps (a random
    model never settles, so every canvas runs to the step limit) and Gemma's two stop tokens."""
    return {
        "bos_token_id": ids[BOS],
        "confidence_threshold": 0.005,
        "eos_token_id": [ids[EOS], ids[TURN_END]],
        "max_denoising_steps": 8,
        "max_new_tokens": 64,
        "pad_token_id": ids[PAD],
        "return_dict_in_generate": True,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
        "stability_threshold": 1,
        "t_max": 0.8,
        "t_min": 0.4,
    }


def tensor_shapes(shape: DemoShape) -> dict[str, tuple[int, ...]]:
    """Every stored tensor's name and shape, in the order the weights are drawn."""
    h, inter, moe = shape.hidden, shape.intermediate, shape.moe_intermediate
    out: dict[str, tuple[int, ...]] = {"model.decoder.embed_tokens.weight": (shape.vocab_size, h)}
    for i, kind in enumerate(shape.layer_types):
        p = f"model.decoder.layers.{i}"
        full = kind == "full_attention"
        head_dim = shape.global_head_dim if full else shape.head_dim
        kv_heads = shape.global_kv_heads if full else shape.kv_heads
        out[f"{p}.self_attn.q_proj.weight"] = (shape.heads * head_dim, h)
        out[f"{p}.self_attn.k_proj.weight"] = (kv_heads * head_dim, h)
        if not full:
            out[f"{p}.self_attn.v_proj.weight"] = (kv_heads * head_dim, h)
        out[f"{p}.self_attn.o_proj.weight"] = (h, shape.heads * head_dim)
        out[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
        out[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
        out[f"{p}.mlp.gate_proj.weight"] = (inter, h)
        out[f"{p}.mlp.up_proj.weight"] = (inter, h)
        out[f"{p}.mlp.down_proj.weight"] = (h, inter)
        out[f"{p}.router.proj.weight"] = (shape.experts, h)
        out[f"{p}.router.scale"] = (h,)
        out[f"{p}.router.per_expert_scale"] = (shape.experts,)
        out[f"{p}.experts.gate_up_proj"] = (shape.experts, 2 * moe, h)
        out[f"{p}.experts.down_proj"] = (shape.experts, h, moe)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_2",
        ):
            out[f"{p}.{norm}.weight"] = (h,)
        out[f"{p}.layer_scalar"] = (1,)
    out["model.decoder.norm.weight"] = (h,)
    sc = "model.decoder.self_conditioning"
    out[f"{sc}.pre_norm.weight"] = (h,)
    out[f"{sc}.gate_proj.weight"] = (inter, h)
    out[f"{sc}.up_proj.weight"] = (inter, h)
    out[f"{sc}.down_proj.weight"] = (h, inter)
    for i in range(shape.layers):
        # A buffer, so not covered by the encoder-decoder weight tie: stored for both stacks.
        out[f"model.encoder.language_model.layers.{i}.layer_scalar"] = (1,)
    vh, vi, vq = shape.vision_hidden, shape.vision_intermediate, shape.vision_heads
    tower = "model.encoder.vision_tower"
    out[f"{tower}.patch_embedder.input_proj.weight"] = (vh, 3 * shape.patch_size**2)
    out[f"{tower}.patch_embedder.position_embedding_table"] = (
        2,
        shape.position_embedding_size,
        vh,
    )
    for j in range(shape.vision_layers):
        p = f"{tower}.encoder.layers.{j}"
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"{p}.self_attn.{proj}.linear.weight"] = (vq * shape.vision_head_dim, vh)
        out[f"{p}.self_attn.o_proj.linear.weight"] = (vh, vq * shape.vision_head_dim)
        out[f"{p}.self_attn.q_norm.weight"] = (shape.vision_head_dim,)
        out[f"{p}.self_attn.k_norm.weight"] = (shape.vision_head_dim,)
        out[f"{p}.mlp.gate_proj.linear.weight"] = (vi, vh)
        out[f"{p}.mlp.up_proj.linear.weight"] = (vi, vh)
        out[f"{p}.mlp.down_proj.linear.weight"] = (vh, vi)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            out[f"{p}.{norm}.weight"] = (vh,)
    out["model.encoder.embed_vision.embedding_projection.weight"] = (h, vh)
    return out


# Scales and norm weights sit near 1 rather than at it, and the embedding is wide enough for
# peaked logits: a reference comparison then sees every parameter and tells positions apart.
_NEAR_ONE = ("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")
_EMBEDDING_STD = 0.25


def _weights(shape: DemoShape, seed: int) -> dict[str, Any]:
    """Random float32 tensors for `tensor_shapes(shape)`, drawn in that order from `seed`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, size in tensor_shapes(shape).items():
        if name.startswith("model.encoder.language_model."):
            # The encoder is the decoder's text stack run causally: the same values.
            out[name] = out[name.replace("encoder.language_model", "decoder")].clone()
            continue
        noise = torch.randn(*size, generator=gen)
        if name.endswith(_NEAR_ONE):
            out[name] = 1.0 + 0.1 * noise
        elif name.endswith("embed_tokens.weight"):
            out[name] = _EMBEDDING_STD * noise
        else:
            # Fan-in scaling keeps each layer's output the size of its input.
            out[name] = noise * size[-1] ** -0.5
    return out


def _write_tokenizer(out: Path, shape: DemoShape) -> dict[str, int]:
    """Write `tokenizer.json` + `tokenizer_config.json`; return the special tokens' ids."""
    from tokenizers import AddedToken

    tokenizer = train_tokenizer(shape.bpe_vocab, special_tokens=SPECIAL_TOKENS, added_tokens=[])
    # Gemma's vocabulary also reserves unused slots; here they make the tokenizer define exactly
    # the embedding's rows, so no id the model can sample lacks a token.
    missing = shape.vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    unused = [f"<unused{i}>" for i in range(missing)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in unused])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + unused}
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS + unused
    }
    _write_json(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": added,
            "boi_token": IMAGE_START,
            "bos_token": BOS,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eoi_token": IMAGE_END,
            "eos_token": EOS,
            "image_token": IMAGE,
            "model_max_length": shape.max_positions,
            "pad_token": PAD,
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    return {t: ids[t] for t in SPECIAL_TOKENS}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # transformers' layout (sorted keys, two-space indent): also fixes the bytes run to run.
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def create_diffusion_gemma_demo(
    directory: str | Path, *, seed: int = 0, shape: DemoShape = TINY
) -> Path:
    """Write a random DiffusionGemma checkpoint of SHAPE (the tiny demo unless given; a larger
    one for benchmarks) into `directory` (created if missing) and return its path. Raises
    ValueError for a negative seed or a directory holding files."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (got {seed})")
    out = prepare_demo_directory(directory)
    from safetensors.torch import save_file  # torch: only once the arguments are known good

    ids = _write_tokenizer(out, shape)
    _write_json(out / "config.json", checkpoint_config(shape, ids))
    _write_json(out / "generation_config.json", generation_config(ids))
    # One metadata key: safetensors keeps metadata in a hash map, so more keys could reorder.
    save_file(_weights(shape, seed), str(out / "model.safetensors"), {"format": "pt"})
    return out
