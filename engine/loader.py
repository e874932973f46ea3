"""Loads a Hugging Face checkpoint directory (config + safetensors) into an engine `Model`.

Every tensor header is read and checked before any weight is: all missing, unexpected and
mis-shaped tensors are reported in one `CheckpointError`. Weights are then copied tensor by
tensor, shard by shard, straight into the preallocated model (peak RAM ~ one tensor above it).
Expert weights are accepted per expert (`mlp.experts.{e}.gate_proj.weight`, as real SDAR /
Qwen3-MoE checkpoints store them) or stacked (`mlp.experts.gate_up_proj`, transformers 5).
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine import packing
from engine.config import ModelConfig, read_checkpoint_json
from engine.errors import CheckpointError
from engine.memory import canonical_dtype
from engine.model import Model
from engine.packing import PackPolicy
from engine.tokenizer import find_mask_token_id, load_tokenizer

if TYPE_CHECKING:
    from engine.families.diffusion_gemma.model import DiffusionGemmaModel

__all__ = [
    "CheckedCheckpoint",
    "check_sdar_checkpoint",
    "copy_tensors",
    "load_checkpoint_config",
    "load_model",
    "load_sdar_model",
    "load_tokenizer",
    "resolve_dtype",
]

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_SAFETENSORS_DTYPES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
# Names some exporters add that carry no weights of ours.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_MAX_LISTED = 12


def _checkpoint_dir(path: str | Path) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; point at a checkpoint directory")
    if not (root / "config.json").is_file():
        raise CheckpointError(f"{root / 'config.json'}: missing; a checkpoint needs config.json")
    return root


def load_checkpoint_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (config, generation config, tokenizer mask)."""
    root = _checkpoint_dir(path)
    gen_file = root / "generation_config.json"
    return ModelConfig.from_hf(
        read_checkpoint_json(root / "config.json"),
        read_checkpoint_json(gen_file) if gen_file.is_file() else None,
        tokenizer_mask_token_id=find_mask_token_id(root),
        source=str(root / "config.json"),
    )


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint: str | None) -> torch.dtype:
    """The dtype to load in: the one asked for, else the checkpoint's own, else fp32."""
    choice = dtype if dtype is not None and dtype != "auto" else checkpoint
    if choice is None:
        return torch.float32
    try:
        return _TORCH_DTYPES[canonical_dtype(choice)]
    except ValueError as exc:
        raise CheckpointError(str(exc)) from exc


@dataclass(frozen=True)
class _Header:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def _read_header(file: Path) -> dict[str, _Header]:
    """Tensor names, shapes and dtypes of one safetensors file; checks the file is complete."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: truncated (no safetensors header); re-download it")
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise CheckpointError(f"{file}: truncated header; re-download it")
            meta = json.loads(fh.read(length))
    except OSError as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{file}: corrupt safetensors header ({exc}); re-download it"
        ) from exc
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header; re-download it")
    headers: dict[str, _Header] = {}
    data_end = 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            shape = tuple(int(d) for d in info["shape"])
            dtype = str(info["dtype"])
            data_end = max(data_end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{file}: corrupt entry for tensor {name!r}") from exc
        headers[name] = _Header(file, shape, dtype)
    if 8 + length + data_end > size:
        raise CheckpointError(
            f"{file}: truncated: {size} bytes on disk, the header describes "
            f"{8 + length + data_end}; re-download it"
        )
    return headers


def _weight_file(root: Path, name: str, listed_in: Path | None) -> Path:
    """The weight file `name` of the checkpoint, refused unless it lies inside `root`.

    A checkpoint comes from whoever published it: a shard name like `../../etc/passwd`, an
    absolute path, or a symlink out of the directory would make the engine open any file the
    process can read (or a device that never ends) as weights.
    """
    where = f"{listed_in}: shard" if listed_in else "weight file"
    file = root / name
    inside = not Path(name).is_absolute() and file.resolve().is_relative_to(root.resolve())
    if not inside:
        raise CheckpointError(
            f"{where} {name!r} lies outside the checkpoint directory {root} (an absolute path, "
            "'..' or a symlink out); refusing to read it: weights must be files inside the "
            "checkpoint directory"
        )
    if not file.is_file():
        listed = f"listed in {listed_in.name} but " if listed_in else ""
        raise CheckpointError(f"{file}: {listed}missing or not a regular file")
    return file


def _checkpoint_headers(root: Path) -> dict[str, _Header]:
    """Headers of every tensor in a single-file or sharded checkpoint."""
    index_file = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    if index_file.is_file():
        weight_map = read_checkpoint_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file}: field 'weight_map' is missing or empty")
        headers: dict[str, _Header] = {}
        for shard in weight_map.values():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(f"{index_file}: shard {shard!r} is not a file name")
        for shard in sorted(set(weight_map.values())):
            headers.update(_read_header(_weight_file(root, shard, index_file)))
        absent = sorted(n for n in weight_map if n not in headers)
        if absent:
            raise CheckpointError(
                f"{index_file}: lists tensors no shard holds: {_listing(absent)}; re-download it"
            )
        return headers
    if single.is_file():
        return _read_header(_weight_file(root, single.name, None))
    files = sorted(_weight_file(root, f.name, None) for f in root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{root}: no model.safetensors, model.safetensors.index.json or *.safetensors files"
        )
    merged: dict[str, _Header] = {}
    for file in files:
        merged.update(_read_header(file))
    return merged


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter of ours and an index into it."""

    param: str
    index: tuple[Any, ...]
    shape: tuple[int, ...]


def _tensor_plan(cfg: ModelConfig) -> tuple[dict[str, _Target], list[list[list[str]]]]:
    """All checkpoint names we understand, and the required groups (each: alternative layouts)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    targets: dict[str, _Target] = {}
    groups: list[list[list[str]]] = []

    def need(hf: str, param: str, shape: tuple[int, ...], index: tuple[Any, ...] = ()) -> None:
        targets[hf] = _Target(param, index, shape)
        groups.append([[hf]])

    need("model.embed_tokens.weight", "embed.weight", (cfg.vocab_size, h))
    need("model.norm.weight", "norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        need("lm_head.weight", "lm_head.weight", (cfg.vocab_size, h))
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        need(hf + "input_layernorm.weight", ours + "attn_norm.weight", (h,))
        need(hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight", (h,))
        spans = {
            "q_proj": slice(0, q),
            "k_proj": slice(q, q + kv),
            "v_proj": slice(q + kv, q + 2 * kv),
        }
        for proj, rows in spans.items():
            size = rows.stop - rows.start
            need(f"{hf}self_attn.{proj}.weight", ours + "attn.wqkv.weight", (size, h), (rows,))
            if cfg.attention_bias:
                need(f"{hf}self_attn.{proj}.bias", ours + "attn.wqkv.bias", (size,), (rows,))
        need(hf + "self_attn.o_proj.weight", ours + "attn.wo.weight", (h, q))
        if cfg.attention_bias:
            need(hf + "self_attn.o_proj.bias", ours + "attn.wo.bias", (h,))
        need(hf + "self_attn.q_norm.weight", ours + "attn.q_norm.weight", (d,))
        need(hf + "self_attn.k_norm.weight", ours + "attn.k_norm.weight", (d,))
        if cfg.is_moe_layer(i):
            _plan_experts(cfg, hf + "mlp.", ours + "mlp.", targets, groups)
            need(hf + "mlp.gate.weight", ours + "mlp.router", (cfg.num_experts, h))
        else:
            inter = cfg.intermediate_size
            gate_up = ours + "mlp.w_gate_up.weight"
            need(hf + "mlp.gate_proj.weight", gate_up, (inter, h), (slice(0, inter),))
            need(hf + "mlp.up_proj.weight", gate_up, (inter, h), (slice(inter, 2 * inter),))
            need(hf + "mlp.down_proj.weight", ours + "mlp.w_down.weight", (h, inter))
    return targets, groups


def _plan_experts(
    cfg: ModelConfig,
    hf: str,
    ours: str,
    targets: dict[str, _Target],
    groups: list[list[list[str]]],
) -> None:
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    fused_gu, fused_down = hf + "experts.gate_up_proj", hf + "experts.down_proj"
    targets[fused_gu] = _Target(ours + "w_gate_up", (), (e, 2 * inter, h))
    targets[fused_down] = _Target(ours + "w_down", (), (e, h, inter))
    gate_up: list[str] = []
    down: list[str] = []
    for x in range(e):
        p = f"{hf}experts.{x}."
        targets[p + "gate_proj.weight"] = _Target(
            ours + "w_gate_up", (x, slice(0, inter)), (inter, h)
        )
        targets[p + "up_proj.weight"] = _Target(
            ours + "w_gate_up", (x, slice(inter, 2 * inter)), (inter, h)
        )
        targets[p + "down_proj.weight"] = _Target(ours + "w_down", (x,), (h, inter))
        gate_up += [p + "gate_proj.weight", p + "up_proj.weight"]
        down.append(p + "down_proj.weight")
    # Per-expert first: that is the layout of the checkpoints on the Hub, so it is what a
    # "missing" report names.
    groups.append([gate_up, [fused_gu]])
    groups.append([down, [fused_down]])


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _select(cfg: ModelConfig, headers: dict[str, _Header], root: Path) -> dict[str, _Target]:
    """Checks names and shapes against the model; returns checkpoint name -> target to load."""
    targets, groups = _tensor_plan(cfg)
    chosen: dict[str, _Target] = {}
    missing: list[str] = []
    for alternatives in groups:
        present = next((alt for alt in alternatives if all(n in headers for n in alt)), None)
        if present is None:
            missing += [n for n in alternatives[0] if n not in headers]
            continue
        chosen.update({n: targets[n] for n in present})
    understood = set(targets)
    if cfg.tie_word_embeddings:
        # HF writes no head for tied models, but some exporters keep the duplicate.
        understood.add("lm_head.weight")
    unexpected = sorted(
        n for n in headers if n not in understood and not n.endswith(_IGNORED_SUFFIXES)
    )
    misshaped = [
        f"{n} {list(headers[n].shape)} (expected {list(t.shape)})"
        for n, t in chosen.items()
        if headers[n].shape != t.shape
    ]
    unsupported = sorted(
        f"{n} ({headers[n].dtype})" for n in chosen if headers[n].dtype not in _SAFETENSORS_DTYPES
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_listing(unexpected)}")
    if misshaped:
        problems.append(f"tensors with the wrong shape: {_listing(misshaped)}")
    if unsupported:
        problems.append(
            f"tensors of an unsupported dtype (need F32/BF16/F16): {_listing(unsupported)}"
        )
    if problems:
        raise CheckpointError(
            f"{root}: the weights do not match config.json ({cfg.model_type}, "
            f"{cfg.num_layers} layers): " + "; ".join(problems)
        )
    return chosen


def copy_tensors(
    chosen: dict[str, _Target], headers: dict[str, _Header], params: dict[str, torch.Tensor]
) -> None:
    """Copies each chosen checkpoint tensor into its target (a parameter or buffer in PARAMS,
    or an index of one), file by file, tensor by tensor."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in chosen:
        by_file[headers[name].file].append(name)
    with torch.no_grad():
        for file, names in sorted(by_file.items()):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for name in names:
                        target = chosen[name]
                        param = params[target.param]
                        dest = param[target.index] if target.index else param
                        dest.copy_(reader.get_tensor(name))
            except Exception as exc:
                # safetensors raises its own error types for damaged files; name the file.
                raise CheckpointError(
                    f"{file}: cannot read tensors ({exc}); re-download it"
                ) from exc


def load_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    packed_weights: PackPolicy = "off",
) -> Model | DiffusionGemmaModel:
    """Builds the model of a checkpoint directory and loads its weights, checked first: an
    SDAR-family `Model` (`load_sdar_model`), or a `DiffusionGemmaModel` when config.json says
    `model_type: diffusion_gemma` (`engine.families.diffusion_gemma.weights`; it ignores
    packed_weights)."""
    root = _checkpoint_dir(path)
    if read_checkpoint_json(root / "config.json").get("model_type") == "diffusion_gemma":
        from engine.families.diffusion_gemma.weights import load_diffusion_gemma

        return load_diffusion_gemma(root, device=device, dtype=dtype, compute_dtype=compute_dtype)
    return load_sdar_model(
        root,
        device=device,
        dtype=dtype,
        compute_dtype=compute_dtype,
        packed_weights=packed_weights,
    )


@dataclass(frozen=True)
class CheckedCheckpoint:
    """An SDAR-family checkpoint whose tensor headers were checked against its config: which
    checkpoint tensor fills which parameter of the whole model, and the weights' dtype."""

    root: Path
    config: ModelConfig
    headers: dict[str, _Header]
    chosen: dict[str, _Target]
    dtype: torch.dtype  # what the weights are loaded as (the one asked for, else as stored)


def check_sdar_checkpoint(
    path: str | Path, dtype: str | torch.dtype | None = None
) -> CheckedCheckpoint:
    """Reads config and every tensor header of an SDAR-family checkpoint and checks them (one
    CheckpointError listing every problem); reads no weights. DTYPE as `load_sdar_model`."""
    root = _checkpoint_dir(path)
    cfg = load_checkpoint_config(root)
    headers = _checkpoint_headers(root)
    chosen = _select(cfg, headers, root)
    stored = headers["model.embed_tokens.weight"].dtype
    target_dtype = resolve_dtype(dtype, _SAFETENSORS_DTYPES.get(stored, cfg.torch_dtype))
    return CheckedCheckpoint(root, cfg, headers, chosen, target_dtype)


def load_sdar_model(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
    packed_weights: PackPolicy = "off",
) -> Model:
    """Builds the SDAR-family model (Qwen3 / Qwen3-MoE layout) of a checkpoint directory and
    loads its weights, checked first.

    compute_dtype: activation dtype; by default the weights' dtype, or fp32 for bf16/fp16
    weights on a CPU without native half-precision matmuls.
    packed_weights: whether to move the projection weights into oneDNN's CPU layout after
    loading (engine.packing; inference only). "off" by default here: serving asks for "auto".
    """
    checked = check_sdar_checkpoint(path, dtype)
    cfg, headers, chosen = checked.config, checked.headers, checked.chosen
    # Built on the meta device so no time goes into random init of weights about to be loaded.
    model = Model(cfg, dtype=checked.dtype, device="meta", compute_dtype=compute_dtype)
    model.materialize(device)
    params = dict(model.named_parameters())
    covered: dict[str, int] = defaultdict(int)
    for target in chosen.values():
        covered[target.param] += prod(target.shape)
    uncovered = [n for n, p in params.items() if covered[n] != p.numel()]
    if uncovered:
        # A bug in the name plan, not in the checkpoint: never serve uninitialised weights.
        raise RuntimeError(f"loader plan leaves parameters unfilled: {uncovered}")

    copy_tensors(chosen, headers, params)
    model.eval()
    model.pack_weights(
        packing.scope(packed_weights, model.device, model.dtype, model.compute_dtype)
    )
    return model
