"""The DiffusionGemma model: an encoder over committed tokens and a decoder over a canvas.

The encoder runs the layers over the prompt and, later, over each committed canvas, causally
(or bidirectionally, per `use_bidirectional_attention`), and keeps only what the decoder needs:
every layer's keys and values, in an `EncoderKV`. The decoder runs the same layers (the
reference ties the two stacks) over a canvas placed right after the encoded tokens, attending
bidirectionally to the whole canvas and to the encoded keys (see `config` for the windows). Its
input is the canvas embedding plus a self-conditioning signal from the previous step's logits,
and its output the soft-capped logits.

Two forms of one computation:
- slot form, for continuous batching: `encode_into(kv, ids, slots, cache_lens)` and
  `denoise_batch(kv, canvas, slots, cache_lens, ...)`, each row at its own length;
- simple form: `encode(ids, cache)` -> `EncoderCache`, `denoise(cache, canvas, ...)`, a thin
  wrapper that gives every batch row its own slot.

A model may be one rank's share of a tensor-parallel model (`engine.parallel`): its config holds
the rank's heads, K/V heads and intermediate sizes, its `ModelShard` the vocabulary rows and
experts held and the exchanges that complete each partial result (none in one process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from engine.families.diffusion_gemma.config import SLIDING, DiffusionGemmaConfig
from engine.families.diffusion_gemma.kv import EncoderKV, cached_positions
from engine.families.diffusion_gemma.layers import DenseMLP, Layer, rms_norm
from engine.families.diffusion_gemma.masks import additive, decoder_visibility, encoder_visibility
from engine.model import (
    WHOLE_MODEL,
    ModelShard,
    default_compute_dtype,
    rotary_tables,
    vocab_logits,
)

# The simple form's store grows in steps of this many positions (then doubles).
_CACHE_STEP = 256
# Vocabulary rows widened at a time when embeddings are stored narrower than the compute dtype.
_VOCAB_SLICE_BYTES = 4 << 20


@dataclass
class EncoderCache:
    """The simple form's cache: one slot per batch row, every row `length` tokens long."""

    kv: EncoderKV
    length: int = 0

    @property
    def batch_size(self) -> int:
        """Rows the cache holds."""
        return self.kv.num_slots


@dataclass
class _Pass:
    """What every layer of one encoder or decoder pass shares."""

    kv: EncoderKV
    slots: Tensor
    rope: dict[str, tuple[Tensor, Tensor]]  # layer type -> (cos, signed sin), see rotary_tables
    cached: dict[str, int]  # layer type -> store indices read per row
    masks: dict[str, Tensor | None]  # layer type -> additive mask over cached + own keys
    positions: Tensor  # (N, T) absolute positions of this pass's tokens
    keep: dict[str, Tensor | None] | None = None  # encoder: which of its K/V to store


def rotary_inv_freq(
    head_dim: int, rope_type: str, theta: float, partial: float, factor: float
) -> Tensor:
    """Inverse frequencies (head_dim // 2,) of one layer type. `proportional` rotates the first
    `partial` of the pairs at the frequencies of the full head and leaves the rest unrotated."""
    if rope_type == "default":
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    rotated = int(partial * head_dim // 2)
    inv = 1.0 / theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.float32) / head_dim)
    return torch.cat((inv, torch.zeros(head_dim // 2 - rotated))) / factor


def soft_embeddings(probs: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """probs (..., V) @ weight (V, hidden) in DTYPE; a narrower-stored weight is widened a slice
    of rows at a time, never whole (a 262k-row embedding is gigabytes in fp32)."""
    if weight.dtype == dtype:
        return probs.to(dtype) @ weight
    rows = max(1, _VOCAB_SLICE_BYTES // (weight.shape[1] * 4))
    out = probs.new_zeros(*probs.shape[:-1], weight.shape[1], dtype=dtype)
    for start in range(0, weight.shape[0], rows):
        out += probs[..., start : start + rows].to(dtype) @ weight[start : start + rows].to(dtype)
    return out


class DiffusionGemmaModel(nn.Module):
    """Embeddings, the shared layer stack, the self-conditioning MLP, final norm and tied head.

    SHARD: the part of the model this process holds (`ModelShard`; the whole by default)."""

    family = "diffusion-gemma"  # its runner: engine.families.diffusion_gemma.runner

    def __init__(
        self,
        config: DiffusionGemmaConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        compute_dtype: torch.dtype | None = None,
        shard: ModelShard = WHOLE_MODEL,
    ) -> None:
        super().__init__()
        dev = torch.device(device)
        kw = {"dtype": dtype, "device": dev}
        self.config = config
        self.shard = shard
        self._compute_dtype = compute_dtype
        start, stop = shard.vocab_rows(config.vocab_size)
        h, v, n = config.hidden_size, stop - start, config.num_layers

        def stack() -> nn.ModuleList:
            return nn.ModuleList(Layer(config, i, shard=shard, **kw) for i in range(n))

        self.embed = nn.Embedding(v, h, **kw)
        self.layers = stack()
        self.norm = nn.Parameter(torch.ones(h, **kw))
        self.self_cond_norm = nn.Parameter(torch.ones(h, **kw))
        self.self_cond = DenseMLP(h, config.intermediate_size, config.hidden_activation, **kw)
        # Untied checkpoints (top-level tie_word_embeddings: false) keep a second stack.
        self.encoder_embed: nn.Embedding | None = None
        self.encoder_layers: nn.ModuleList | None = None
        self.lm_head: nn.Parameter | None = None
        if not config.tie_word_embeddings:
            self.encoder_embed = nn.Embedding(v, h, **kw)
            self.encoder_layers = stack()
            self.lm_head = nn.Parameter(torch.empty(v, h, **kw))
        # The per-layer output scalars: buffers in the reference, never tied between the stacks.
        self.register_buffer("encoder_scalars", torch.ones(n, **kw))
        self.register_buffer("decoder_scalars", torch.ones(n, **kw))
        for kind in set(config.layer_types):
            half = config.head_dims[config.layer_types.index(kind)] // 2
            self.register_buffer(f"inv_freq_{kind}", torch.empty(half, device=dev), False)
        if dev.type != "meta":
            self.reset_buffers()

    def materialize(self, device: str | torch.device) -> DiffusionGemmaModel:
        """Allocates (uninitialised) storage on DEVICE for a model built on the meta device."""
        self.to_empty(device=torch.device(device))
        self.reset_buffers()
        return self

    def reset_buffers(self) -> None:
        """Recomputes the rotary frequencies (after `to_empty`)."""
        cfg = self.config
        for kind, rope in cfg.rope.items():
            buffer = getattr(self, f"inv_freq_{kind}")
            head_dim = cfg.head_dims[cfg.layer_types.index(kind)]
            inv = rotary_inv_freq(
                head_dim, rope.rope_type, rope.theta, rope.partial_rotary_factor, rope.factor
            )
            with torch.no_grad():
                buffer.copy_(inv)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return self.embed.weight.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of activations (see `engine.model.default_compute_dtype`); logits are fp32."""
        return self._compute_dtype or default_compute_dtype(self.dtype, self.device)

    @property
    def weights_layout(self) -> str:
        """How the projection weights are held: plain (no oneDNN packing for this family)."""
        return "plain"

    @property
    def device(self) -> torch.device:
        """Device of the weights."""
        return self.embed.weight.device

    def weight_bytes(self) -> int:
        """Bytes the weights take (a tied matrix once)."""
        tensors = [*self.parameters(), self.encoder_scalars, self.decoder_scalars]
        return sum(t.numel() * t.element_size() for t in tensors)

    def new_kv(self, num_slots: int, max_seq_len: int) -> EncoderKV:
        """An empty `EncoderKV` for this model, in its compute dtype, on its device."""
        return EncoderKV(
            self.config, num_slots, max_seq_len, dtype=self.compute_dtype, device=self.device
        )

    # -- simple form ------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, prompt_ids: Tensor, cache: EncoderCache | None = None) -> EncoderCache:
        """Encodes PROMPT_IDS (B, T) after what CACHE holds (a new cache when None) and returns
        the cache, now T tokens longer (the same object when one was given)."""
        b, t = prompt_ids.shape
        if cache is None:
            cache = EncoderCache(self.new_kv(b, _grown(0, t)))
        if cache.batch_size != b:
            raise ValueError(f"the cache holds {cache.batch_size} rows, prompt_ids has {b}")
        if cache.length + t > cache.kv.max_seq_len:
            cache.kv = cache.kv.resized(
                _grown(cache.kv.max_seq_len, cache.length + t), cache.length
            )
        slots = torch.arange(b, device=self.device)
        lens = torch.full((b,), cache.length, device=self.device)
        self.encode_into(cache.kv, prompt_ids.to(self.device), slots, lens)
        cache.length += t
        return cache

    @torch.no_grad()
    def denoise(
        self,
        cache: EncoderCache,
        canvas_ids: Tensor,
        self_conditioning_logits: Tensor | None = None,
    ) -> Tensor:
        """The decoder's soft-capped logits (B, C, V) fp32 for CANVAS_IDS (B, C) placed right
        after the cache's tokens, self-conditioned on the previous step's logits (B, C, V)."""
        b = canvas_ids.shape[0]
        if cache.batch_size != b:
            raise ValueError(f"the cache holds {cache.batch_size} rows, canvas_ids has {b}")
        slots = torch.arange(b, device=self.device)
        lens = torch.full((b,), cache.length, device=self.device)
        return self.denoise_batch(
            cache.kv, canvas_ids.to(self.device), slots, lens, self_conditioning_logits
        )

    # -- slot form --------------------------------------------------------------------------

    @torch.no_grad()
    def encode_into(
        self,
        kv: EncoderKV,
        ids: Tensor,
        slots: Tensor,
        cache_lens: Tensor,
        lengths: Tensor | None = None,
    ) -> None:
        """Encodes IDS (N, T) at positions cache_lens[i] + 0..T-1 of SLOTS (N,), each row over
        its own cached prefix, and stores their keys and values. With LENGTHS (N,), row i's
        tokens past lengths[i] are padding: neither attended to nor stored."""
        n, t = ids.shape
        lens = self._check_call(kv, n, slots, cache_lens, t, lengths)
        positions = cache_lens.view(-1, 1) + torch.arange(t, device=ids.device)
        own = torch.arange(t, device=ids.device).view(1, -1)
        real = None if lengths is None else own < lengths.view(-1, 1)
        step = self._pass(kv, slots, cache_lens, positions, lens, encoder=True, real=real)
        step.keep = {}
        for kind, cap in self._capacities(kv).items():
            count = torch.full_like(cache_lens, t) if lengths is None else lengths
            # A ring keeps each row's last `cap` tokens; one position per index.
            tail = own >= count.view(-1, 1) - cap
            keep = tail if real is None else tail & real
            step.keep[kind] = None if lengths is None and t <= cap else keep
        embed = self.embed if self.encoder_embed is None else self.encoder_embed
        layers = self.layers if self.encoder_layers is None else self.encoder_layers
        self._run(self._embed(embed, ids), layers, self.encoder_scalars, step)

    @torch.no_grad()
    def denoise_batch(
        self,
        kv: EncoderKV,
        canvas: Tensor,
        slots: Tensor,
        cache_lens: Tensor,
        self_conditioning_logits: Tensor | None = None,
        self_conditioning_mask: Tensor | None = None,
    ) -> Tensor:
        """The decoder's soft-capped logits (N, C, V) fp32 for CANVAS (N, C), row i placed right
        after the cache_lens[i] tokens of slots[i]. SELF_CONDITIONING_LOGITS (N, C, V): the
        previous step's logits; SELF_CONDITIONING_MASK (N,) bool: rows without them (their
        first step) are False, as if no logits were given for them. A shard of a parallel
        model takes (and a non-driving one returns) its own vocabulary columns of V."""
        n, c = canvas.shape
        lens = self._check_call(kv, n, slots, cache_lens, 0, None)
        positions = cache_lens.view(-1, 1) + torch.arange(c, device=canvas.device)
        step = self._pass(kv, slots, cache_lens, positions, lens, encoder=False, real=None)
        x = self._canvas_input(canvas, self_conditioning_logits, self_conditioning_mask)
        x = self._run(x, self.layers, self.decoder_scalars, step)
        head = self.embed.weight if self.lm_head is None else self.lm_head
        logits = vocab_logits(
            rms_norm(x, self.norm, self.config.rms_norm_eps).view(n * c, -1), head
        )
        cap = self.config.final_logit_softcapping
        return self.shard.gather_vocab(torch.tanh(logits.float() / cap) * cap).view(n, c, -1)

    # -- internals --------------------------------------------------------------------------

    def _embed(self, embed: nn.Embedding, ids: Tensor) -> Tensor:
        # The scale is rounded to the weights' dtype first, as the reference does.
        scale = torch.tensor(self.config.hidden_size**0.5, dtype=embed.weight.dtype)
        return (self.shard.embed(embed, ids) * scale.to(self.device)).to(self.compute_dtype)

    def _canvas_input(
        self, canvas: Tensor, sc_logits: Tensor | None, sc_mask: Tensor | None
    ) -> Tensor:
        """Canvas embeddings plus the self-conditioning signal, normed (no weight)."""
        eps, x = self.config.rms_norm_eps, self._embed(self.embed, canvas)
        if sc_logits is not None:
            vocab = self.embed.num_embeddings  # the vocabulary rows this shard holds
            if sc_logits.shape != (*canvas.shape, vocab):
                raise ValueError(
                    f"self_conditioning_logits must be {(*canvas.shape, vocab)}"
                    f", got {tuple(sc_logits.shape)}"
                )
            # Cast to the embeddings' dtype before the softmax, as the reference's generate()
            # hands them over (a no-op in fp32; bf16 rounds the logits first).
            probs = self.shard.softmax_vocab(sc_logits.to(self.device, self.dtype))
            # Soft tokens: the expected embedding under the previous step's distribution.
            scale = torch.tensor(self.config.hidden_size**0.5, dtype=self.dtype).to(x.dtype)
            soft = soft_embeddings(probs.to(self.dtype), self.embed.weight, x.dtype)
            soft = self.shard.reduce(soft) * scale
            if sc_mask is not None:
                soft = torch.where(sc_mask.to(self.device).view(-1, 1, 1), soft, 0.0)
            # A zero signal adds exactly nothing (no biases, gelu(0) = 0): skipped when absent.
            x = x + self.shard.reduce(self.self_cond(rms_norm(soft, self.self_cond_norm, eps)))
        return rms_norm(x, None, eps)

    def _capacities(self, kv: EncoderKV) -> dict[str, int]:
        kinds = self.config.layer_types
        return {kind: kv.capacities[kinds.index(kind)] for kind in set(kinds)}

    def _pass(
        self,
        kv: EncoderKV,
        slots: Tensor,
        cache_lens: Tensor,
        positions: Tensor,
        lens: tuple[int, int],
        *,
        encoder: bool,
        real: Tensor | None,
    ) -> _Pass:
        """Rotary tables and masks per layer type for queries at POSITIONS (N, T)."""
        cfg, dtype = self.config, self.compute_dtype
        min_len, max_len = lens
        rope: dict[str, tuple[Tensor, Tensor]] = {}
        cached: dict[str, int] = {}
        masks: dict[str, Tensor | None] = {}
        for kind, cap in self._capacities(kv).items():
            rope[kind] = rotary_tables(positions, getattr(self, f"inv_freq_{kind}"), dtype)
            cached[kind] = length = min(cap, max_len)
            held = cached_positions(cache_lens, cap, length)
            if encoder:
                window = cfg.sliding_context if kind == SLIDING else None
                causal = not cfg.bidirectional_encoder
                allowed = encoder_visibility(positions, held, real, causal=causal, window=window)
            elif min_len >= length:
                masks[kind] = None  # every row sees every key: no mask to add
                continue
            else:
                allowed = decoder_visibility(held, positions.shape[1])
            masks[kind] = additive(allowed, dtype)
        return _Pass(kv, slots, rope, cached, masks, positions)

    def _run(self, x: Tensor, layers: nn.ModuleList, scalars: Tensor, step: _Pass) -> Tensor:
        """The layers over x (N, T, hidden) against the store; an encoder pass (`step.keep` set)
        stores every layer's keys and values and stops at the last layer's."""
        eps, last = self.config.rms_norm_eps, len(layers) - 1
        for i, layer in enumerate(layers):
            kind = self.config.layer_types[i]
            cos, sin = step.rope[kind]
            h = rms_norm(x, layer.input_norm, eps)
            k, v = layer.attn.keys_values(h, cos, sin)
            ck, cv = step.kv.read(i, step.slots, step.cached[kind])
            keys = torch.cat((ck.to(k.dtype), k), dim=2)
            values = torch.cat((cv.to(v.dtype), v), dim=2)
            if step.keep is not None:
                # After the read: a ring index this call overwrites may still be read above.
                step.kv.write(i, step.slots, step.positions, k, v, step.keep[kind])
                if i == last:
                    break  # nothing reads the encoder's output, only its keys and values
            q = layer.attn.queries(h, cos, sin)
            attended = self.shard.reduce(layer.attn.attend(q, keys, values, step.masks[kind]))
            x = x + rms_norm(attended, layer.post_attn_norm, eps)
            x = layer.feed_forward(x, scalars[i])
        return x

    def _check_call(
        self,
        kv: EncoderKV,
        n: int,
        slots: Tensor,
        cache_lens: Tensor,
        new_tokens: int,
        lengths: Tensor | None,
    ) -> tuple[int, int]:
        """Validates a call's slots and lengths (one host sync); returns the shortest and the
        longest cache_len."""
        if slots.shape != (n,) or cache_lens.shape != (n,):
            raise ValueError(f"slots and cache_lens must have shape ({n},), one per row")
        if lengths is not None and lengths.shape != (n,):
            raise ValueError(f"lengths must have shape ({n},), one per row")
        if kv.config is not self.config and kv.config != self.config:
            raise ValueError("the EncoderKV was made for another model configuration")
        lows_highs = [slots.min(), slots.max(), cache_lens.min(), cache_lens.max()]
        if lengths is not None:
            lows_highs += [lengths.min(), lengths.max()]
        bounds = torch.stack(lows_highs).tolist()
        low_slot, top_slot, low_len, top_len = bounds[:4]
        if low_slot < 0 or top_slot >= kv.num_slots:
            raise ValueError(f"slots must be in [0, {kv.num_slots}), got {low_slot}..{top_slot}")
        if low_len < 0 or top_len + new_tokens > kv.max_seq_len:
            raise ValueError(
                f"cache_lens {low_len}..{top_len} plus {new_tokens} new tokens exceed the "
                f"{kv.max_seq_len} positions a slot holds"
            )
        if lengths is not None and (bounds[4] < 0 or bounds[5] > new_tokens):
            raise ValueError(f"lengths must be in [0, {new_tokens}]")
        return int(low_len), int(top_len)


def _grown(current: int, needed: int) -> int:
    """The simple form's next store size: a step, then doubling, until NEEDED fits."""
    size = max(current, _CACHE_STEP)
    while size < needed:
        size *= 2
    return size


__all__ = ["DiffusionGemmaModel", "EncoderCache", "EncoderKV"]
