"""One way to build an engine from a checkpoint: model, tokenizer, memory plan, KV cache, core.

`LLM`, `engine.serve` and `dctl tune` all call `build_engine`, so the device, the memory plan
and its budget, the dtype the weights are kept in, their packed layout and the cache are
decided in one place, and the same options give the same engine whichever entry point asked.
Each entry point only translates its own arguments into `EngineOptions`.

What depends on the model family (reading its config, planning its memory, loading its weights,
building its core) starts in `load_family`, the one place that branches on it. A model split
over several ranks (`engine.parallel`) is built there too, from the group rank 0 joined: each
rank loads its share and the core drives rank 0's `RankZeroModel` as it drives a whole model.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from engine import packing
from engine.config import ModelConfig, read_checkpoint_json
from engine.core import EngineCore
from engine.errors import CheckpointError, EngineError
from engine.families.registry import FAMILY_MODEL_TYPES, family_of
from engine.loader import load_checkpoint_config, load_sdar_model, load_tokenizer, resolve_dtype
from engine.memory import MemoryPlan, canonical_dtype, plan_memory, resident_dtype
from engine.model import Model, default_compute_dtype
from engine.packing import PackPolicy
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
    from engine.families.diffusion_gemma.model import DiffusionGemmaModel
    from engine.parallel.driver import ParallelModel
    from engine.parallel.group import RankGroup
    from engine.parallel.plan import ExpertPlacement

log = logging.getLogger("engine.factory")

ResidentPolicy = Literal["auto", "stored", "compute"]


@dataclass(frozen=True)
class EngineOptions:
    """How to build an engine. The defaults are the in-process library's (`LLM`); the server
    fills every field from its configuration (`engine.serve.engine_options`)."""

    # None or "auto": the dtype the checkpoint stores.
    dtype: str | torch.dtype | None = None
    # "auto": CUDA when torch sees a GPU, else the CPU.
    device: str = "cpu"
    max_batch_size: int = 16
    max_seq_len: int = 4096
    packed_weights: PackPolicy = "auto"
    # Where the CPU computes half precision in fp32: keep the weights as stored ("stored"),
    # widen them once at load ("compute"), or widen when they fit the RAM budget ("auto").
    resident_weights: ResidentPolicy = "stored"
    # Share of the device's memory the engine may use: a GPU's cap (the load fails beyond it)
    # and the CPU's RAM budget for resident_weights "auto". None: no budget, no cap.
    memory_fraction: float | None = None
    # torch's CPU threads (a process-wide setting); None leaves torch's choice.
    threads: int | None = None
    # Count tokens per MoE expert (for /metrics); off where nobody reads them.
    track_experts: bool = False
    # Where routed experts go when the model is split over ranks (`engine.parallel.plan`).
    experts: ExpertPlacement = "expert"


@dataclass
class BuiltEngine:
    """A checkpoint loaded and ready to decode: what every entry point drives."""

    model: Model | DiffusionGemmaModel | ParallelModel
    tokenizer: Tokenizer
    config: ModelConfig | DiffusionGemmaConfig
    core: EngineCore
    plan: MemoryPlan
    device: str
    options: EngineOptions


def build_engine(
    checkpoint_dir: str | Path,
    options: EngineOptions | None = None,
    *,
    group: RankGroup | None = None,
) -> BuiltEngine:
    """Load the checkpoint in CHECKPOINT_DIR as OPTIONS say and build its core. GROUP: the
    process group rank 0 (this process) joined, whose other ranks run `serve_worker`; the model
    is split over it (`options.experts` placing the experts). None: one process.

    Raises CheckpointError for a bad checkpoint or dtype, EngineError when the memory plan does
    not fit the device's budget, ParallelPlanError when the model does not split over GROUP.
    """
    options = options or EngineOptions()
    if options.threads:
        torch.set_num_threads(options.threads)
    device = str(group.device) if group is not None else resolve_device(options.device)
    return load_family(Path(checkpoint_dir), options, device, group)


def resolve_device(requested: str) -> str:
    """The device to load on: REQUESTED, or for "auto" CUDA when available, else the CPU."""
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_family(
    root: Path, options: EngineOptions, device: str, group: RankGroup | None = None
) -> BuiltEngine:
    """The model-family part of building: the one place that branches on the family
    (`engine.families.registry`, from config.json's model_type), and on a split model (GROUP
    of more than one rank: `build_parallel`, either family)."""
    source = root / "config.json"
    # Without config.json the loader's own errors say what to fix (not a directory, missing).
    raw = read_checkpoint_json(source) if source.is_file() else {}
    family = family_of(raw, source=str(source)) if raw else "sdar"
    if group is not None and group.size > 1:
        return build_parallel(root, options, group, family)
    if family == "sdar":
        return build_sdar(root, options, device)
    if family == "diffusion-gemma":
        return build_diffusion_gemma(root, options, device)
    raise CheckpointError(
        f"{source}: the engine cannot serve the {family} family yet; serve a checkpoint of "
        f"model_type {', '.join(t for types in FAMILY_MODEL_TYPES.values() for t in types)}"
    )


def build_diffusion_gemma(root: Path, options: EngineOptions, device: str) -> BuiltEngine:
    """DiffusionGemma checkpoints (`engine.families.diffusion_gemma`): memory plan and budget,
    the text model's weights (a vision tower is not loaded), tokenizer and core. Weights are
    kept as stored and stay in the plain layout (no packing for this family yet)."""
    from engine.families.diffusion_gemma import memory as dg_memory
    from engine.families.diffusion_gemma.weights import (
        load_diffusion_gemma,
        load_diffusion_gemma_config,
    )

    config = load_diffusion_gemma_config(root)
    plan_dtype = canonical_dtype(resolve_dtype(options.dtype, config.torch_dtype))
    plan = dg_memory.plan_memory(config, plan_dtype, options.max_batch_size, options.max_seq_len)
    log.info("memory plan", extra={"device": device, "dtype": plan_dtype, **plan.to_dict()})
    if device.startswith("cuda"):
        reserve_gpu_memory(plan.total_bytes, device, options.memory_fraction)
    if config.has_vision_tower:
        log.info(
            "vision tower not loaded: this engine serves DiffusionGemma's text model only "
            "(a request with an image part is a 400)",
            extra={"path": str(root)},
        )
    start = time.perf_counter()
    model = load_diffusion_gemma(root, device=device, dtype=options.dtype)
    tokenizer = load_tokenizer(root)
    log.info(
        "weights loaded",
        extra={
            "path": str(root),
            "weights_bytes": model.weight_bytes(),
            "seconds": round(time.perf_counter() - start, 3),
            "dtype": str(model.dtype).removeprefix("torch."),
        },
    )
    core = EngineCore(
        model,
        tokenizer,
        max_batch_size=options.max_batch_size,
        max_seq_len=options.max_seq_len,
    )
    return BuiltEngine(model, tokenizer, config, core, plan, device, options)


def build_sdar(root: Path, options: EngineOptions, device: str) -> BuiltEngine:
    """Block-diffusion checkpoints of the Qwen3-MoE layout (`engine.config.ModelConfig`):
    memory plan and budget, the weights' dtype and layout, tokenizer and core."""
    config = load_checkpoint_config(root)
    plan_dtype = canonical_dtype(resolve_dtype(options.dtype, config.torch_dtype))
    plan = plan_memory(config, plan_dtype, options.max_batch_size, options.max_seq_len)
    log.info("memory plan", extra={"device": device, "dtype": plan_dtype, **plan.to_dict()})
    if device.startswith("cuda"):
        reserve_gpu_memory(plan.total_bytes, device, options.memory_fraction)
    load_dtype = options.dtype
    if device == "cpu":
        native = _cpu_computes_natively(plan_dtype)
        resident = cpu_weights_dtype(config, plan_dtype, options, native=native)
        # Unchanged, the dtype asked for stays: None lets the loader keep what the file stores.
        load_dtype = resident if resident != plan_dtype else load_dtype

    start = time.perf_counter()
    model = load_sdar_model(root, device=device, dtype=load_dtype)
    tokenizer = load_tokenizer(root)
    log.info(
        "weights loaded",
        extra={
            "path": str(root),
            "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "seconds": round(time.perf_counter() - start, 3),
            "dtype": str(model.dtype).removeprefix("torch."),
        },
    )
    pack_weights(model, options.packed_weights)
    model.track_experts(options.track_experts)
    compute = str(model.compute_dtype).removeprefix("torch.")
    log.info("compute dtype", extra={"compute_dtype": compute, "device": device})
    core = EngineCore(
        model,
        tokenizer,
        max_batch_size=options.max_batch_size,
        max_seq_len=options.max_seq_len,
    )
    return BuiltEngine(model, tokenizer, config, core, plan, device, options)


def build_parallel(
    root: Path, options: EngineOptions, group: RankGroup, family: str
) -> BuiltEngine:
    """A model of either FAMILY split over GROUP (`engine.parallel`): the plan checked against
    the checkpoint first (ParallelPlanError naming the key and the figures), then every rank's
    share loaded on its own device (`load_parallel_model`), weights kept as stored. The memory
    plan logged and checked is one rank's share."""
    from engine.parallel.driver import ParallelSdarModel, load_parallel_model
    from engine.parallel.plan import ParallelPlan

    config: ModelConfig | DiffusionGemmaConfig
    if family == "diffusion-gemma":
        from engine.families.diffusion_gemma import memory as dg_memory
        from engine.families.diffusion_gemma.weights import load_diffusion_gemma_config

        config = load_diffusion_gemma_config(root)
        plan_dtype = canonical_dtype(resolve_dtype(options.dtype, config.torch_dtype))
        whole = dg_memory.plan_memory(
            config, plan_dtype, options.max_batch_size, options.max_seq_len
        )
    else:
        config = load_checkpoint_config(root)
        plan_dtype = canonical_dtype(resolve_dtype(options.dtype, config.torch_dtype))
        whole = plan_memory(config, plan_dtype, options.max_batch_size, options.max_seq_len)
    parallel = ParallelPlan(group.size, options.experts)
    parallel.check(config)
    device = str(group.device)
    log.info(
        "memory plan",
        extra={"device": device, "dtype": plan_dtype, "ranks": group.size, **whole.to_dict()},
    )
    if device.startswith("cuda"):
        # Each rank holds about 1 / N of the weights and of the K/V heads.
        reserve_gpu_memory(whole.total_bytes // group.size, device, options.memory_fraction)
    start = time.perf_counter()
    model = load_parallel_model(group, root, parallel, dtype=options.dtype)
    tokenizer = load_tokenizer(root)
    log.info(
        "weights loaded",
        extra={
            "path": str(root),
            "ranks": group.size,
            "experts": parallel.experts,
            "rank_weights_bytes": model.weight_bytes(),
            "seconds": round(time.perf_counter() - start, 3),
            "dtype": str(model.dtype).removeprefix("torch."),
        },
    )
    if isinstance(model, ParallelSdarModel):
        pack_weights(model, options.packed_weights)  # type: ignore[arg-type]
        model.track_experts(options.track_experts)
    core = EngineCore(
        model,
        tokenizer,
        max_batch_size=options.max_batch_size,
        max_seq_len=options.max_seq_len,
    )
    return BuiltEngine(model, tokenizer, config, core, whole, device, options)


def reserve_gpu_memory(needed_bytes: int, device: str, fraction: float | None) -> None:
    """Check the plan against FRACTION of the GPU and cap this process there (None: no cap)."""
    if fraction is None:
        return
    index = torch.device(device).index or 0
    budget = int(torch.cuda.get_device_properties(index).total_memory * fraction)
    if needed_bytes > budget:
        raise EngineError(
            f"the model needs {needed_bytes / 2**30:.1f} GiB but "
            f"resources.memory_fraction={fraction} of {device} allows "
            f"{budget / 2**30:.1f} GiB; lower service.max_concurrent_requests or "
            "model.max_seq_len, or use a larger GPU"
        )
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def cpu_weights_dtype(
    config: ModelConfig, stored: str, options: EngineOptions, *, native: bool
) -> str:
    """The dtype the weights are kept in on the CPU: STORED, or fp32 when this CPU has no
    NATIVE half-precision matmuls (activations are fp32 then) and the policy and the RAM budget
    allow widening them once at load rather than at every matmul."""
    compute = stored if native else "fp32"
    widened = plan_memory(config, compute, options.max_batch_size, options.max_seq_len)
    chosen = resident_dtype(
        stored, compute, options.resident_weights, widened.total_bytes, _ram_budget(options)
    )
    if chosen != stored:
        log.info(
            f"weights widened at load: this CPU has no native {stored} matmuls",
            extra={
                "weights_dtype": chosen,
                "bytes": widened.total_bytes,
                "policy": options.resident_weights,
            },
        )
    return chosen


def _cpu_computes_natively(dtype: str) -> bool:
    """Whether this CPU multiplies DTYPE natively (else the model computes in fp32)."""
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    return default_compute_dtype(torch_dtype, torch.device("cpu")) == torch_dtype


def _ram_budget(options: EngineOptions) -> int | None:
    """memory_fraction of this machine's RAM; None without a fraction or where unknown."""
    if options.memory_fraction is None:
        return None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return int(ram * options.memory_fraction)


def pack_weights(model: Model, policy: PackPolicy) -> None:
    """Move the projection weights into oneDNN's CPU layout where POLICY and the CPU say so."""
    scope = packing.scope(policy, model.device, model.dtype, model.compute_dtype)
    if scope == "none":
        return
    start = time.perf_counter()
    extra = model.pack_weights(scope)
    log.info(
        "weights packed for oneDNN",
        extra={
            "scope": scope,
            "extra_bytes": extra,
            "seconds": round(time.perf_counter() - start, 3),
        },
    )
