"""What rank 0 sends the other ranks: one typed message per thing every rank must do.

Rank 0 sends a message (`RankGroup.send`) and then does the same thing itself, so every rank
enters the collectives of a forward in the same order. A model call (`Call`) names the model,
the cache (by number: each rank holds its own part of it) and the forward (`SdarForward`,
`GemmaEncode`, `GemmaDenoise`), whose `run` is the one code every rank executes. Tensors travel
inside the message, on the CPU (ids, positions, slots: a few hundred bytes a step); the large
ones (self-conditioning logits) go by a collective inside `run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from engine.packing import PackScope
from engine.parallel.plan import ParallelPlan

if TYPE_CHECKING:
    from engine.families.diffusion_gemma.kv import EncoderKV
    from engine.families.diffusion_gemma.model import DiffusionGemmaModel
    from engine.kv_cache import KVCache
    from engine.model import Model


@dataclass(frozen=True)
class LoadShard:
    """Load your shard of the checkpoint at PATH as model number MODEL."""

    model: int
    path: str
    plan: ParallelPlan
    dtype: str | torch.dtype | None  # as the loaders take it; None keeps the checkpoint's
    compute_dtype: torch.dtype | None  # None: the model's default


@dataclass(frozen=True)
class PackWeights:
    """Move model MODEL's projections into oneDNN's layout (`Model.pack_weights`)."""

    model: int
    scope: PackScope


@dataclass(frozen=True)
class ReleaseModel:
    """Drop model MODEL and its caches."""

    model: int


@dataclass(frozen=True)
class Stop:
    """Leave the worker loop: the group is closing."""


@dataclass(frozen=True)
class CacheRef:
    """Rank 0's cache NUMBER, as each rank allocates its own part: its K/V heads only."""

    number: int
    num_slots: int
    max_seq_len: int
    dtype: str  # torch dtype name

    def allocate(self, model: Model | DiffusionGemmaModel) -> KVCache | EncoderKV:
        """This rank's part of the cache, for its shard of the model."""
        from engine.families.diffusion_gemma.kv import EncoderKV
        from engine.kv_cache import KVCache
        from engine.model import Model

        dtype = dtype_of(self.dtype)
        if isinstance(model, Model):
            return KVCache(
                model.config, self.num_slots, self.max_seq_len, dtype=dtype, device=model.device
            )
        return EncoderKV(
            model.config, self.num_slots, self.max_seq_len, dtype=dtype, device=model.device
        )


@dataclass(frozen=True)
class SdarForward:
    """`Model.forward` with these arguments."""

    input_ids: Tensor
    positions: Tensor | None
    block_size: int | Tensor
    slots: Tensor | None
    cache_lens: Tensor | None
    write_cache: bool
    logits_rows: Tensor | None

    def run(self, model: Any, cache: Any, payload: Tensor | None) -> Tensor:
        """The forward on this rank's shard: the logits on rank 0, its columns elsewhere."""
        dev = model.device
        block = self.block_size
        return model(
            self.input_ids.to(dev),
            _to(self.positions, dev),
            block_size=block.to(dev) if isinstance(block, Tensor) else block,
            cache=cache,
            slots=_to(self.slots, dev),
            cache_lens=_to(self.cache_lens, dev),
            write_cache=self.write_cache,
            logits_rows=_to(self.logits_rows, dev),
        )


@dataclass(frozen=True)
class GemmaEncode:
    """`DiffusionGemmaModel.encode_into` with these arguments."""

    ids: Tensor
    slots: Tensor
    cache_lens: Tensor
    lengths: Tensor | None

    def run(self, model: Any, cache: Any, payload: Tensor | None) -> None:
        """Encodes into this rank's part of the store."""
        dev = model.device
        model.encode_into(
            cache,
            self.ids.to(dev),
            self.slots.to(dev),
            self.cache_lens.to(dev),
            _to(self.lengths, dev),
        )


@dataclass(frozen=True)
class GemmaDenoise:
    """`DiffusionGemmaModel.denoise_batch` with these arguments; the self-conditioning logits
    (when `conditioning_dtype` is set) are scattered by vocabulary columns from rank 0's
    PAYLOAD inside `run`, not sent in the message."""

    canvas: Tensor
    slots: Tensor
    cache_lens: Tensor
    conditioning_dtype: str | None
    conditioning_mask: Tensor | None

    def run(self, model: Any, cache: Any, payload: Tensor | None) -> Tensor:
        """The decoder on this rank's shard: the logits on rank 0, its columns elsewhere."""
        dev = model.device
        canvas = self.canvas.to(dev)
        columns = None
        if self.conditioning_dtype is not None:
            dtype = dtype_of(self.conditioning_dtype)
            columns = model.shard.scatter_vocab(payload, tuple(canvas.shape), dtype, dev)
        return model.denoise_batch(
            cache,
            canvas,
            self.slots.to(dev),
            self.cache_lens.to(dev),
            columns,
            _to(self.conditioning_mask, dev),
        )


Forward = SdarForward | GemmaEncode | GemmaDenoise


@dataclass(frozen=True)
class Call:
    """Run FORWARD on model MODEL with cache CACHE (allocated on first sight); first drop the
    RELEASED caches, which rank 0 no longer holds."""

    model: int
    cache: CacheRef | None
    released: tuple[int, ...]
    forward: Forward


Message = LoadShard | PackWeights | ReleaseModel | Stop | Call


def describe(error: BaseException) -> str:
    """An error as one line for another rank: its type and message."""
    return f"{type(error).__name__}: {error}"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype called NAME ("float32" or "torch.float32")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def cpu(tensor: Tensor | None) -> Tensor | None:
    """TENSOR on the CPU, for a message (None stays None)."""
    return None if tensor is None else tensor.detach().cpu()


def _to(tensor: Tensor | None, device: torch.device) -> Tensor | None:
    return None if tensor is None else tensor.to(device)
