"""The `transformers` DiffusionGemma as a yardstick for our generation loop.

- `tiny_reference_model()`: a random `DiffusionGemmaForBlockDiffusion` small enough to build in
  well under a second (2 layers, vocab 128, canvas 8, a sliding window shorter than the prompt),
  with its layers' and self-conditioning's residual branches scaled down so the decoder mostly
  echoes its canvas: canvases then settle, and the stable-and-confident stop fires after a few
  steps instead of never (a plain random model is chaotic in its canvas).
- `ReferenceDenoiser`: that model behind our `Denoiser` protocol, making the calls its own
  `generate()` makes (encoder masks, position ids, the self-conditioning dtype).
- `reference_generate(...)`: the reference's `generate()` after `torch.manual_seed(seed)`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSamplerConfig,
)

from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding

VOCAB = 128
CANVAS = 8
# Longer than the sliding window (8), so sliding layers drop context, and not a whole canvas.
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
# How much of each residual branch is kept: small enough that canvases settle.
BRANCH_SCALE = 0.05


def tiny_reference_config() -> DiffusionGemmaConfig:
    """A tiny DiffusionGemma config (vision tower shrunk too: the default one is 168 M)."""
    return DiffusionGemmaConfig(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "global_head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "max_position_embeddings": 256,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 16,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "bos_token_id": 2,
            # Wide weights give peaked logits: entropies spread, so acceptance varies.
            "initializer_range": 1.0,
        },
        vision_config={
            "model_type": "gemma4_vision",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
        },
        canvas_length=CANVAS,
        initializer_range=1.0,
    )


def tiny_reference_model(seed: int = 0) -> DiffusionGemmaForBlockDiffusion:
    """The tiny reference model, random weights from SEED, residual branches scaled down."""
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(tiny_reference_config()).eval()
    with torch.no_grad():
        # The decoder's layers are the encoder's (tied), so this scales both.
        for layer in model.model.decoder.layers:
            layer.post_attention_layernorm.weight.mul_(BRANCH_SCALE)
            layer.post_feedforward_layernorm.weight.mul_(BRANCH_SCALE)
        model.model.decoder.self_conditioning.down_proj.weight.mul_(BRANCH_SCALE)
    return model


class ReferenceDenoiser:
    """The reference model's encoder and decoder as our `Denoiser` (batch 1)."""

    def __init__(self, model: DiffusionGemmaForBlockDiffusion) -> None:
        self.model = model

    def encode(self, ids: torch.Tensor, cache: Any = None) -> Any:
        """Encodes IDS after the cache, with the masks and positions generate() gives."""
        model = self.model
        if cache is None:
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        past, n = cache.get_seq_length(), ids.shape[1]
        positions = torch.arange(past, past + n, dtype=torch.int32).unsqueeze(0)
        masks = model.model.encoder.create_masks_for_generate(
            config=model.config,
            inputs_embeds=torch.empty((1, n, 0), dtype=model.dtype),
            attention_mask=torch.ones((1, past + n), dtype=torch.bool),
            cache=cache,
            position_ids=positions,
        )
        out = model.model.encoder(
            input_ids=ids, attention_mask=masks, cache=cache, position_ids=positions
        )
        return out.cache

    def denoise(
        self,
        cache: Any,
        canvas_ids: torch.Tensor,
        self_conditioning_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder's soft-capped logits for the canvas placed after the cache."""
        model = self.model
        past, length = cache.get_seq_length(), canvas_ids.shape[1]
        positions = torch.arange(past, past + length, dtype=torch.int32).unsqueeze(0)
        if self_conditioning_logits is not None:
            embedding_dtype = model.model.decoder.embed_tokens.weight.dtype
            self_conditioning_logits = self_conditioning_logits.to(embedding_dtype)
        out = model(
            decoder_input_ids=canvas_ids,
            cache=cache,
            self_conditioning_logits=self_conditioning_logits,
            decoder_position_ids=positions,
        )
        return out.logits


def reference_generate(
    model: DiffusionGemmaForBlockDiffusion,
    prompt: list[int],
    decoding: DiffusionGemmaDecoding,
    *,
    max_new_tokens: int,
    seed: int,
) -> Any:
    """The reference's `generate()` output for DECODING's settings after torch.manual_seed."""
    eos = list(decoding.eos_token_ids)
    torch.manual_seed(seed)
    return model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        max_denoising_steps=decoding.max_denoising_steps,
        t_min=decoding.t_min,
        t_max=decoding.t_max,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=decoding.entropy_bound),
        stability_threshold=decoding.stability_threshold,
        confidence_threshold=decoding.confidence_threshold,
        eos_token_id=eos or None,
        pad_token_id=decoding.pad_token_id,
    )
