"""Model configuration read from a Hugging Face `config.json` (Qwen3 / Qwen3-MoE / SDAR layouts).

Importable without torch: the CLI and the agent use it to describe and size a checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError

log = logging.getLogger(__name__)

MOE_TYPES = ("qwen3_moe", "sdar_moe")
DENSE_TYPES = ("qwen3", "sdar")
SUPPORTED_TYPES = MOE_TYPES + DENSE_TYPES

# SDAR checkpoints were trained with these; real ones sometimes leave them out of config.json.
SDAR_DEFAULT_MASK_TOKEN_ID = 151669
SDAR_DEFAULT_BLOCK_SIZE = 4
# Block size used when a checkpoint can diffuse but names no block size and has no family default.
GENERIC_DEFAULT_BLOCK_SIZE = 4

_MASK_KEYS = ("mask_token_id", "mask_id")
_BLOCK_KEYS = ("block_size", "block_length", "dllm_block_length")
_ROPE_TYPES = ("default", "linear")


def read_checkpoint_json(path: Path) -> dict[str, Any]:
    """One JSON object file of a checkpoint (config, generation / tokenizer config, index)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return data


def _fail(source: str, field_name: str, problem: str) -> CheckpointError:
    return CheckpointError(
        f"{source}: field '{field_name}' {problem} "
        f"(supported model_type values: {', '.join(SUPPORTED_TYPES)})"
    )


def _get_int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        value = default
    if value is None:
        raise _fail(source, key, "is required but missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _fail(source, key, f"must be a non-negative integer, got {value!r}")
    return value


def _get_positive(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = _get_int(cfg, key, source, default)
    if value == 0:
        raise _fail(source, key, "must be positive, got 0")
    return value


def _get_float(cfg: dict[str, Any], key: str, source: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise _fail(source, key, f"must be a positive number, got {value!r}")
    return float(value)


def _get_bool(cfg: dict[str, Any], key: str, source: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _fail(source, key, f"must be true or false, got {value!r}")
    return value


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _first_int(sources: list[dict[str, Any]], keys: tuple[str, ...]) -> int | None:
    for src in sources:
        for key in keys:
            value = src.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, str, float]:
    """Returns (theta, rope type, linear factor) from any of the three spellings HF has used."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta_src: dict[str, Any] = cfg
    rope_type, factor = "default", 1.0
    for name, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if spec is None:
            continue
        if not isinstance(spec, dict):
            raise _fail(source, name, f"must be an object, got {spec!r}")
        if "rope_theta" in spec:
            theta_src = spec
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in _ROPE_TYPES:
            raise _fail(
                source, f"{name}.rope_type", f"is {kind!r}; supported: {', '.join(_ROPE_TYPES)}"
            )
        if kind == "linear":
            rope_type, factor = "linear", _get_float(spec, "factor", source, 1.0)
    theta = _get_float(theta_src, "rope_theta", source, 10000.0)
    return theta, rope_type, factor


@dataclass
class ModelConfig:
    """Architecture and diffusion settings of one checkpoint, in the engine's own names."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    mask_token_id: int | None = None
    block_size: int = 1
    eos_token_ids: list[int] = field(default_factory=list)
    # dtype the checkpoint declares ("bfloat16", "float32", ...), if any.
    torch_dtype: str | None = None
    # Human-readable notes about defaults that were filled in (also logged as warnings).
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_hf(
        cls,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        tokenizer_mask_token_id: int | None = None,
        source: str = "config.json",
    ) -> ModelConfig:
        """Reads a HF `config.json` dict; raises CheckpointError naming the file and the field."""
        if not isinstance(config, dict):
            raise CheckpointError(f"{source}: must hold a JSON object")
        gen = generation_config or {}
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise _fail(source, "model_type", f"is {model_type!r}, which this engine cannot run")
        is_moe = model_type in MOE_TYPES
        if config.get("use_sliding_window"):
            raise _fail(
                source, "use_sliding_window", "is true; sliding-window attention is not supported"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise _fail(source, "hidden_act", f"is {act!r}; only 'silu' is supported")

        num_heads = _get_positive(config, "num_attention_heads", source)
        hidden = _get_positive(config, "hidden_size", source)
        num_kv = _get_positive(config, "num_key_value_heads", source, num_heads)
        if num_heads % num_kv:
            raise _fail(
                source,
                "num_key_value_heads",
                f"({num_kv}) must divide num_attention_heads ({num_heads})",
            )
        # Qwen3 dense configs default head_dim to 128; Qwen3-MoE to hidden / heads (as HF does).
        head_default = 128 if not is_moe else hidden // num_heads
        head_dim = _get_positive(config, "head_dim", source, head_default)
        if head_dim % 2:
            raise _fail(source, "head_dim", f"must be even for rotary embeddings, got {head_dim}")
        num_layers = _get_positive(config, "num_hidden_layers", source)

        num_experts = top_k = moe_inter = 0
        sparse_step = 1
        mlp_only: list[int] = []
        if is_moe:
            experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
            num_experts = _get_positive(config, experts_key, source)
            top_k = _get_positive(config, "num_experts_per_tok", source)
            if top_k > num_experts:
                raise _fail(
                    source,
                    "num_experts_per_tok",
                    f"({top_k}) exceeds the number of experts ({num_experts})",
                )
            moe_inter = _get_positive(config, "moe_intermediate_size", source)
            sparse_step = _get_positive(config, "decoder_sparse_step", source, 1)
            raw_only = config.get("mlp_only_layers") or []
            if not isinstance(raw_only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in raw_only
            ):
                raise _fail(
                    source, "mlp_only_layers", f"must be a list of layer indices, got {raw_only!r}"
                )
            mlp_only = sorted(set(raw_only))
        has_dense = not is_moe or any(
            i in mlp_only or (i + 1) % sparse_step != 0 for i in range(num_layers)
        )
        inter = (
            _get_positive(config, "intermediate_size", source)
            if has_dense
            else _get_int(config, "intermediate_size", source, 0)
        )
        theta, rope_type, rope_factor = _rope(config, source)

        notes: list[str] = []
        sources = [config, gen]
        mask_id = _first_int(sources, _MASK_KEYS)
        if mask_id is None:
            mask_id = tokenizer_mask_token_id
        if mask_id is None and model_type.startswith("sdar"):
            mask_id = SDAR_DEFAULT_MASK_TOKEN_ID
            notes.append(f"mask_token_id not found; using the SDAR default {mask_id}")
        block = _first_int(sources, _BLOCK_KEYS)
        if block is None:
            if model_type.startswith("sdar"):
                block = SDAR_DEFAULT_BLOCK_SIZE
                notes.append(f"block_size not found; using the SDAR default {block}")
            elif mask_id is not None:
                block = GENERIC_DEFAULT_BLOCK_SIZE
                notes.append(f"block_size not found; using {block}")
            else:
                block = 1
        if block < 1:
            raise _fail(source, "block_size", f"must be at least 1, got {block}")
        if mask_id is None:
            notes.append("no mask token: this checkpoint runs as a causal LM and cannot diffuse")
        elif not 0 <= mask_id < _get_positive(config, "vocab_size", source):
            raise _fail(source, "mask_token_id", f"({mask_id}) is outside the vocabulary")
        eos: list[int] = []
        for value in (config.get("eos_token_id"), gen.get("eos_token_id")):
            eos += [t for t in _token_ids(value) if t not in eos]
        for note in notes:
            log.warning("%s: %s", source, note)

        dtype = config.get("torch_dtype", config.get("dtype"))
        return cls(
            model_type=model_type,
            vocab_size=_get_positive(config, "vocab_size", source),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            intermediate_size=inter,
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=rope_factor,
            rms_norm_eps=_get_float(config, "rms_norm_eps", source, 1e-6),
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=moe_inter,
            norm_topk_prob=_get_bool(config, "norm_topk_prob", source, False) if is_moe else False,
            decoder_sparse_step=sparse_step,
            mlp_only_layers=mlp_only,
            tie_word_embeddings=_get_bool(config, "tie_word_embeddings", source, False),
            attention_bias=_get_bool(config, "attention_bias", source, False),
            max_position_embeddings=_get_positive(config, "max_position_embeddings", source, 32768),
            mask_token_id=mask_id,
            block_size=block,
            eos_token_ids=eos,
            torch_dtype=dtype if isinstance(dtype, str) else None,
            notes=notes,
        )

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` has a sparse MoE block (else a dense SwiGLU MLP)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_moe(self) -> bool:
        """Whether any layer is an MoE layer."""
        return any(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def can_diffuse(self) -> bool:
        """Whether block-diffusion decoding is possible (the mask token is known)."""
        return self.mask_token_id is not None

    def num_parameters(self) -> int:
        """Number of parameters the model holds (all experts included; tied head counted once)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        bias = (q + 2 * kv + h) if self.attention_bias else 0
        attn = h * (q + 2 * kv) + q * h + bias + 2 * d
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                mlp = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + 2 * h
        return total
