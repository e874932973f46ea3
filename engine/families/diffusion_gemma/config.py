"""DiffusionGemma's configuration, read from a checkpoint's `config.json` and
`generation_config.json` (`model_type: diffusion_gemma`).

Importable without torch. Fields a checkpoint leaves out take the reference's defaults
(`transformers.models.diffusion_gemma`, built on the Gemma 4 text config); a field that is
present but unusable is a `CheckpointError` naming the file and the field.

Attention windows, in one place (the model and the K/V store follow these numbers):
- causal encoder (`use_bidirectional_attention` unset or "vision": text tokens are causal): a
  sliding layer's query at position p sees keys q with p - W < q <= p (W = `sliding_window`);
- bidirectional encoder (`use_bidirectional_attention: "all"`): a sliding layer's query sees keys
  with |p - q| <= W // 2 (Gemma 3's bidirectional window, what flash attention runs with the
  reference's halved window);
- the decoder sees all of the canvas and, in sliding layers, the last `sliding_context` encoded
  tokens (W - 1, or W // 2 for a bidirectional encoder): what the reference's sliding cache
  layers keep. Full-attention layers see everything encoded before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding

log = logging.getLogger(__name__)

MODEL_TYPE = "diffusion_gemma"
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
# Per-layer overrides (`text_config.per_layer_config`) this engine honours.
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")

# Reference defaults (DiffusionGemmaTextConfig / DiffusionGemmaConfig, transformers 5.24).
_SLIDING_PATTERN = 6  # every 6th layer is full attention when layer_types is absent
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_GLOBAL_HEAD_DIM = 512
_SOFTCAP = 30.0
_CANVAS_LENGTH = 256
_IMAGE_TOKEN_ID = 258_880


class _Fields:
    """Typed reads from one JSON object; errors name the file and the dotted field."""

    def __init__(self, data: dict[str, Any], source: str, prefix: str = "") -> None:
        self.data, self.source, self.prefix = data, source, prefix

    def fail(self, key: str, problem: str) -> CheckpointError:
        """The error for field KEY of this object."""
        return CheckpointError(f"{self.source}: field '{self.prefix}{key}' {problem}")

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value, DEFAULT when absent or null."""
        value = self.data.get(key)
        return default if value is None else value

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        """An integer >= MINIMUM (required when DEFAULT is None)."""
        value = self.get(key, default)
        if value is None:
            raise self.fail(key, "is required but missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str, default: float, *, allow_zero: bool = False) -> float:
        """A positive number (or >= 0 with ALLOW_ZERO)."""
        value = self.get(key, default)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise self.fail(key, f"must be a number {bound}, got {value!r}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        """true or false."""
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value

    def token_ids(self, key: str, default: list[int]) -> tuple[int, ...]:
        """One token id or a list of them."""
        value = self.get(key, default)
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.fail(key, f"must be a token id or a list of them, got {value!r}")
        return tuple(values)

    def optional_id(self, key: str, default: int | None) -> int | None:
        """A token id, or None when null."""
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, f"must be a token id or null, got {value!r}")
        return value

    def child(self, key: str) -> _Fields:
        """The nested object KEY ({} when absent or null)."""
        value = self.get(key, {})
        if not isinstance(value, dict):
            raise self.fail(key, f"must be an object, got {value!r}")
        return _Fields(value, self.source, f"{self.prefix}{key}.")


@dataclass(frozen=True)
class RotaryParams:
    """Rotary embedding of one layer type: `default` (every pair rotates) or `proportional`
    (the first `partial_rotary_factor` of the pairs rotate, the rest keep frequency 0)."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """Architecture of one DiffusionGemma checkpoint's text model, in the engine's names.

    Per-layer tuples (`layer_types`, `head_dims`, `num_kv_heads`) have `num_layers` entries:
    sliding and full-attention layers differ in head size and K/V heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    num_kv_heads: tuple[int, ...]
    sliding_window: int
    bidirectional_encoder: bool
    rope: dict[str, RotaryParams]
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    hidden_activation: str
    rms_norm_eps: float
    final_logit_softcapping: float
    tie_word_embeddings: bool
    canvas_length: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    image_token_id: int | None
    has_vision_tower: bool
    decoding: DiffusionGemmaDecoding
    torch_dtype: str | None = None
    model_type: str = MODEL_TYPE

    @classmethod
    def from_hf(
        cls, config: dict[str, Any], generation_config: dict[str, Any] | None, *, source: str
    ) -> DiffusionGemmaConfig:
        """Reads a `config.json` dict (and `generation_config.json`'s, or None); SOURCE names
        the config file in errors (the generation config is its sibling)."""
        if not isinstance(config, dict):
            raise CheckpointError(f"{source}: must hold a JSON object")
        top = _Fields(config, source)
        if config.get("model_type") != MODEL_TYPE:
            raise top.fail("model_type", f"is {config.get('model_type')!r}, not {MODEL_TYPE!r}")
        if not isinstance(config.get("text_config"), dict):
            raise top.fail("text_config", "is required: the text model's settings")
        text = top.child("text_config")

        num_layers = text.integer("num_hidden_layers", 30)
        num_heads = text.integer("num_attention_heads", 8)
        layer_types = _layer_types(text, num_layers)
        head_dims, kv_heads = _per_layer_attention(text, layer_types, num_heads)
        mode = text.get("use_bidirectional_attention")
        if mode not in (None, "all", "vision"):
            raise text.fail(
                "use_bidirectional_attention", f"must be null, 'all' or 'vision', got {mode!r}"
            )
        activation = text.get("hidden_activation", "gelu_pytorch_tanh")
        if activation not in ACTIVATIONS:
            raise text.fail("hidden_activation", f"is {activation!r}; supported: {ACTIVATIONS}")
        num_experts = text.integer("num_experts", None)
        top_k = text.integer("top_k_experts", None)
        if top_k > num_experts:
            raise text.fail("top_k_experts", f"({top_k}) exceeds num_experts ({num_experts})")
        sliding_window = text.integer("sliding_window", 512, minimum=2)
        if text.boolean("attention_bias", False):
            # The reference ties every encoder weight to the decoder's but not biases; no
            # released checkpoint has them.
            raise text.fail("attention_bias", "is true; attention biases are not supported")
        vision = config.get("vision_config")
        dtype = config.get("dtype", config.get("torch_dtype", text.get("dtype")))
        canvas_length = top.integer("canvas_length", _CANVAS_LENGTH)
        eos, pad = text.token_ids("eos_token_id", [1]), text.optional_id("pad_token_id", 0)
        return cls(
            vocab_size=text.integer("vocab_size", 262_144),
            hidden_size=text.integer("hidden_size", 2304),
            intermediate_size=text.integer("intermediate_size", 9216),
            num_layers=num_layers,
            num_heads=num_heads,
            layer_types=layer_types,
            head_dims=head_dims,
            num_kv_heads=kv_heads,
            sliding_window=sliding_window,
            bidirectional_encoder=mode == "all",
            rope=_rope(text, layer_types, head_dims),
            num_experts=num_experts,
            top_k_experts=top_k,
            moe_intermediate_size=text.integer("moe_intermediate_size", None),
            hidden_activation=activation,
            rms_norm_eps=text.number("rms_norm_eps", 1e-6),
            final_logit_softcapping=text.number("final_logit_softcapping", _SOFTCAP),
            # The top-level flag ties everything (encoder to decoder, head to embedding); the
            # text config's own copy is not what the reference reads.
            tie_word_embeddings=top.boolean("tie_word_embeddings", True),
            canvas_length=canvas_length,
            max_position_embeddings=text.integer("max_position_embeddings", 131_072),
            eos_token_ids=eos,
            pad_token_id=pad,
            bos_token_id=text.optional_id("bos_token_id", 2),
            image_token_id=top.optional_id("image_token_id", _IMAGE_TOKEN_ID),
            has_vision_tower=isinstance(vision, dict),
            decoding=DiffusionGemmaDecoding.from_generation_config(
                generation_config,
                canvas_length=canvas_length,
                source=str(Path(source).with_name("generation_config.json")),
                fallback_eos_token_ids=eos,
                fallback_pad_token_id=pad,
            ),
            torch_dtype=dtype if isinstance(dtype, str) else None,
        )

    @property
    def block_size(self) -> int:
        """The block the engine decodes at a time: the canvas."""
        return self.canvas_length

    def is_sliding(self, layer: int) -> bool:
        """Whether LAYER is a sliding-window attention layer."""
        return self.layer_types[layer] == SLIDING

    @property
    def sliding_context(self) -> int:
        """Encoded tokens a sliding layer looks back on (see the module docstring): W - 1 for a
        causal encoder, W // 2 for a bidirectional one; also what the decoder sees of them."""
        w = self.sliding_window
        return w // 2 if self.bidirectional_encoder else w - 1

    def kv_capacities(self, max_seq_len: int) -> tuple[int, ...]:
        """Positions each layer's encoder K/V keeps per sequence: all of MAX_SEQ_LEN in a
        full-attention layer, the last `sliding_context` in a sliding one."""
        return tuple(
            self.sliding_context if self.is_sliding(i) else max_seq_len
            for i in range(self.num_layers)
        )

    def kv_bytes_per_sequence(self, max_seq_len: int, width: int) -> int:
        """Bytes of encoder keys and values one sequence of up to MAX_SEQ_LEN positions needs at
        WIDTH bytes per element (what one `EncoderKV` slot allocates)."""
        layers = zip(
            self.num_kv_heads, self.head_dims, self.kv_capacities(max_seq_len), strict=True
        )
        return sum(2 * kv * d * cap * width for kv, d, cap in layers)


def _layer_types(text: _Fields, num_layers: int) -> tuple[str, ...]:
    raw = text.get("layer_types")
    if raw is None:
        raw = [SLIDING if (i + 1) % _SLIDING_PATTERN else FULL for i in range(num_layers)]
    if (
        not isinstance(raw, list)
        or len(raw) != num_layers
        or any(t not in LAYER_TYPES for t in raw)
    ):
        raise text.fail(
            "layer_types",
            f"must list one of {LAYER_TYPES} per layer ({num_layers}), got {raw!r}",
        )
    types = list(raw)
    if types[-1] != FULL:
        # The reference forces the last layer to full attention; the weights were made that way.
        log.warning(
            "%s: the last layer is %s; using full_attention as the reference does",
            text.source,
            types[-1],
        )
        types[-1] = FULL
    return tuple(types)


def _per_layer_attention(
    text: _Fields, layer_types: tuple[str, ...], num_heads: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Head size and K/V heads of every layer: the global values, overridden per layer by
    `per_layer_config`, or (when that is absent) for full-attention layers by
    `global_head_dim` / `num_global_key_value_heads` as the reference builds it."""
    head_dim = text.integer("head_dim", 256)
    kv_heads = text.integer("num_key_value_heads", 4)
    overrides: dict[int, dict[str, Any]] = {}
    if text.get("per_layer_config") is None:
        full: dict[str, Any] = {"head_dim": text.integer("global_head_dim", _GLOBAL_HEAD_DIM)}
        if text.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = text.integer("num_global_key_value_heads")
        overrides = {i: full for i, t in enumerate(layer_types) if t == FULL}
    else:
        per_layer = text.child("per_layer_config")
        for key, value in per_layer.data.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) < len(layer_types)):
                raise per_layer.fail(key, f"is not a layer index below {len(layer_types)}")
            layer = per_layer.child(key)
            unknown = sorted(set(value) - set(PER_LAYER_KEYS))
            if unknown:
                raise layer.fail(
                    unknown[0],
                    f"is a per-layer override this engine does not "
                    f"support (only {', '.join(PER_LAYER_KEYS)})",
                )
            overrides[int(key)] = {k: layer.integer(k) for k in value}
    dims, heads = [], []
    for i in range(len(layer_types)):
        d = overrides.get(i, {}).get("head_dim", head_dim)
        kv = overrides.get(i, {}).get("num_key_value_heads", kv_heads)
        if d % 2:
            raise text.fail("head_dim", f"of layer {i} must be even for rotary embeddings, got {d}")
        if num_heads % kv:
            raise text.fail(
                "num_key_value_heads",
                f"of layer {i} ({kv}) must divide num_attention_heads ({num_heads})",
            )
        dims.append(d)
        heads.append(kv)
    for kind in LAYER_TYPES:
        sizes = {d for d, t in zip(dims, layer_types, strict=True) if t == kind}
        if len(sizes) > 1:
            # One rotary table per layer type, as in the reference.
            raise text.fail("per_layer_config", f"gives {kind} layers different head sizes {sizes}")
    return tuple(dims), tuple(heads)


def _rope(
    text: _Fields, layer_types: tuple[str, ...], head_dims: tuple[int, ...]
) -> dict[str, RotaryParams]:
    raw = text.get("rope_parameters", _DEFAULT_ROPE)
    if not isinstance(raw, dict):
        raise text.fail("rope_parameters", f"must be an object per layer type, got {raw!r}")
    params = _Fields(raw, text.source, f"{text.prefix}rope_parameters.")
    result: dict[str, RotaryParams] = {}
    for kind in sorted(set(layer_types)):
        if not isinstance(raw.get(kind), dict):
            raise params.fail(kind, "is required: the rotary settings of these layers")
        spec = params.child(kind)
        rope_type = spec.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise spec.fail("rope_type", f"is {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
        rotary = RotaryParams(
            rope_type=rope_type,
            theta=spec.number("rope_theta", 10_000.0),
            partial_rotary_factor=spec.number("partial_rotary_factor", 1.0),
            factor=spec.number("factor", 1.0),
        )
        head_dim = head_dims[layer_types.index(kind)]
        if rope_type == "default" and int(head_dim * rotary.partial_rotary_factor) != head_dim:
            # The reference's default rope then builds a table narrower than the head and fails.
            raise spec.fail("partial_rotary_factor", "must be 1 with rope_type 'default'")
        if rotary.partial_rotary_factor > 1:
            raise spec.fail(
                "partial_rotary_factor", f"must be <= 1, got {rotary.partial_rotary_factor}"
            )
        result[kind] = rotary
    return result
