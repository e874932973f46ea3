"""Loads a DiffusionGemma checkpoint directory into a `DiffusionGemmaModel`.

The reference ties the encoder's text layers, embedding and norm to the decoder's, so a
checkpoint written by `save_pretrained` holds them under the decoder's names
(`model.decoder.layers.N...`) and an exporter may write the encoder's
(`model.encoder.language_model.layers.N...`) instead or as well: each tied weight is read from
the decoder's name when present, else the encoder's, and every copy present must have the right
shape. The per-layer output scalars (`layer_scalar`) are buffers the reference never ties, so
both stacks' are required. An untied checkpoint (top-level `tie_word_embeddings: false`) holds
both stacks and the LM head in full.

The vision tower and the multimodal embedder are not loaded (text only); their tensors are
skipped and counted in the log. Headers are checked before any weight is read: missing,
unexpected and mis-shaped tensors come back together in one `CheckpointError`.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from engine.config import read_checkpoint_json
from engine.errors import CheckpointError
from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.loader import (
    _IGNORED_SUFFIXES,
    _SAFETENSORS_DTYPES,
    _checkpoint_dir,
    _checkpoint_headers,
    _Header,
    _listing,
    _Target,
    copy_tensors,
    resolve_dtype,
)

log = logging.getLogger(__name__)

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
# The multimodal parts of the encoder, which this text-only engine does not load.
SKIPPED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")

# Checkpoint name (after `layers.N.`) -> ours (after `layers.N.`), for the layer weights.
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.q_norm.weight": "attn.q_norm",
    "self_attn.k_norm.weight": "attn.k_norm",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
    "router.proj.weight": "experts.router",
    "router.scale": "experts.router_scale",
    "router.per_expert_scale": "experts.expert_scale",
    "experts.gate_up_proj": "experts.gate_up",
    "experts.down_proj": "experts.down",
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_mlp_norm",
    "post_feedforward_layernorm_1.weight": "post_mlp_norm",
    "pre_feedforward_layernorm_2.weight": "pre_experts_norm",
    "post_feedforward_layernorm_2.weight": "post_experts_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm",
}
_SELF_CONDITIONING = {
    "self_conditioning.pre_norm.weight": "self_cond_norm",
    "self_conditioning.gate_proj.weight": "self_cond.gate.weight",
    "self_conditioning.up_proj.weight": "self_cond.up.weight",
    "self_conditioning.down_proj.weight": "self_cond.down.weight",
}


def load_diffusion_gemma_config(path: str | Path) -> DiffusionGemmaConfig:
    """The DiffusionGemmaConfig of a checkpoint directory (config.json, generation_config.json)."""
    root = _checkpoint_dir(path)
    gen_file = root / "generation_config.json"
    return DiffusionGemmaConfig.from_hf(
        read_checkpoint_json(root / "config.json"),
        read_checkpoint_json(gen_file) if gen_file.is_file() else None,
        source=str(root / "config.json"),
    )


class _Plan:
    """The checkpoint names we understand: required groups of alternative names per weight."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.targets: dict[str, _Target] = {}
        self.groups: list[list[str]] = []  # per weight: its names, the preferred one first
        self.unused: set[str] = set()  # understood, never loaded (an untied copy's duplicate)

    def need(self, ours: str, *names: str, index: tuple[slice, ...] = ()) -> None:
        """Our parameter OURS (or INDEX of it) is read from the first present of NAMES."""
        shape = tuple(self.params[ours][index].shape) if index else tuple(self.params[ours].shape)
        for name in names:
            self.targets[name] = _Target(ours, index, shape)
        self.groups.append(list(names))


def _tensor_plan(cfg: DiffusionGemmaConfig, params: dict[str, torch.Tensor]) -> _Plan:
    plan = _Plan(params)
    tied = cfg.tie_word_embeddings
    for i in range(cfg.num_layers):
        names = dict(_LAYER_NAMES)
        if cfg.is_sliding(i):
            names["self_attn.v_proj.weight"] = "attn.v_proj.weight"
        for hf, ours in names.items():
            decoder, encoder = f"{DECODER}layers.{i}.{hf}", f"{ENCODER}layers.{i}.{hf}"
            if tied:
                plan.need(f"layers.{i}.{ours}", decoder, encoder)
            else:
                plan.need(f"layers.{i}.{ours}", decoder)
                plan.need(f"encoder_layers.{i}.{ours}", encoder)
        here = (slice(i, i + 1),)
        plan.need("decoder_scalars", f"{DECODER}layers.{i}.layer_scalar", index=here)
        plan.need("encoder_scalars", f"{ENCODER}layers.{i}.layer_scalar", index=here)
    if tied:
        plan.need("embed.weight", f"{DECODER}embed_tokens.weight", f"{ENCODER}embed_tokens.weight")
        plan.need("norm", f"{DECODER}norm.weight", f"{ENCODER}norm.weight")
        plan.unused.add("lm_head.weight")  # HF writes no tied head; some exporters keep it
    else:
        plan.need("embed.weight", f"{DECODER}embed_tokens.weight")
        plan.need("encoder_embed.weight", f"{ENCODER}embed_tokens.weight")
        plan.need("norm", f"{DECODER}norm.weight")
        plan.need("lm_head", "lm_head.weight")
        # The encoder's own final norm: nothing reads the encoder's output, only its K/V.
        plan.unused.add(f"{ENCODER}norm.weight")
    for hf, ours in _SELF_CONDITIONING.items():
        plan.need(ours, DECODER + hf)
    return plan


def _select(
    cfg: DiffusionGemmaConfig, plan: _Plan, headers: dict[str, _Header], root: Path
) -> tuple[dict[str, _Target], list[str]]:
    """Checks names and shapes; returns (checkpoint name -> target to load, skipped names)."""
    chosen: dict[str, _Target] = {}
    missing: list[str] = []
    for names in plan.groups:
        present = next((n for n in names if n in headers), None)
        if present is None:
            missing.append(names[0])
        else:
            chosen[present] = plan.targets[present]
    skipped = sorted(n for n in headers if n.startswith(SKIPPED_PREFIXES))
    understood = set(plan.targets) | plan.unused | set(skipped)
    unexpected = sorted(
        n for n in headers if n not in understood and not n.endswith(_IGNORED_SUFFIXES)
    )
    # Every copy present is checked, the one not loaded too: a tied pair must agree.
    misshaped = [
        f"{n} {list(headers[n].shape)} (expected {list(t.shape)})"
        for n, t in sorted(plan.targets.items())
        if n in headers and headers[n].shape != t.shape
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
    return chosen, skipped


@dataclass(frozen=True)
class CheckedCheckpoint:
    """A DiffusionGemma checkpoint whose tensor headers were checked against its config: which
    checkpoint tensor fills which parameter (or buffer) of the whole model, and the weights'
    dtype."""

    root: Path
    config: DiffusionGemmaConfig
    headers: dict[str, _Header]
    chosen: dict[str, _Target]
    skipped: list[str]  # vision tensors, not loaded
    dtype: torch.dtype  # what the weights are loaded as (the one asked for, else as stored)


def check_checkpoint(path: str | Path, dtype: str | torch.dtype | None = None) -> CheckedCheckpoint:
    """Reads config and every tensor header of a DiffusionGemma checkpoint and checks them (one
    CheckpointError listing every problem); reads no weights. DTYPE as `load_diffusion_gemma`."""
    root = _checkpoint_dir(path)
    cfg = load_diffusion_gemma_config(root)
    headers = _checkpoint_headers(root)
    embed = next(
        (
            headers[n]
            for n in (f"{DECODER}embed_tokens.weight", f"{ENCODER}embed_tokens.weight")
            if n in headers
        ),
        None,
    )
    stored = _SAFETENSORS_DTYPES.get(embed.dtype) if embed is not None else None
    target_dtype = resolve_dtype(dtype, stored or cfg.torch_dtype)
    # The whole model's shapes, from a model on the meta device (no storage).
    whole = DiffusionGemmaModel(cfg, dtype=target_dtype, device="meta")
    shapes = dict(whole.named_parameters())
    shapes.update(whole.named_buffers())
    chosen, skipped = _select(cfg, _tensor_plan(cfg, shapes), headers, root)
    return CheckedCheckpoint(root, cfg, headers, chosen, skipped, target_dtype)


def load_diffusion_gemma(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> DiffusionGemmaModel:
    """Builds the text model of a DiffusionGemma checkpoint directory and loads its weights,
    checked first. DTYPE: None / "auto" keeps the checkpoint's own."""
    checked = check_checkpoint(path, dtype)
    root, cfg, headers, chosen = checked.root, checked.config, checked.headers, checked.chosen
    # Built on the meta device so no time goes into random init of weights about to be loaded.
    model = DiffusionGemmaModel(
        cfg, dtype=checked.dtype, device="meta", compute_dtype=compute_dtype
    )
    model.materialize(device)
    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    covered: dict[str, int] = defaultdict(int)
    for target in chosen.values():
        covered[target.param] += prod(target.shape)
    uncovered = [
        n for n, p in params.items() if not n.startswith("inv_freq") and covered[n] != p.numel()
    ]
    if uncovered:
        # A bug in the name plan, not in the checkpoint: never serve uninitialised weights.
        raise RuntimeError(f"loader plan leaves parameters unfilled: {uncovered}")
    copy_tensors(chosen, headers, params)
    if checked.skipped:
        log.info(
            "%s: %d vision tensors not loaded (this engine serves text only)",
            root,
            len(checked.skipped),
        )
    model.eval()
    return model
