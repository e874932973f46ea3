"""Rank 0's side of a parallel model: a model object the unchanged engine core drives.

`load_parallel_model(group, path, plan)` has every rank load its shard and returns, on rank 0,
a `ParallelSdarModel` or `ParallelGemmaModel`: the family's model interface (what its runner
calls, plus what the factory and the server read). Each forward the runner makes is sent to the
other ranks (`messages.Call`) and run on every rank's shard; the logits come back whole on
rank 0.

Caches: the runner makes its cache from the model as it always does (SDAR: `KVCache(model.config,
...)`, DiffusionGemma: `model.new_kv(...)`). `config` is rank 0's share of the config (its heads
and K/V heads; vocabulary, experts, token ids and block size are the model's), so that cache is
rank 0's own part. The other ranks know it only by a number: on its first call each allocates
its own part, of the same slots and length; when rank 0 drops its cache the number goes out
with the next call and the others free theirs.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from engine.config import ModelConfig
from engine.errors import EngineError
from engine.families.diffusion_gemma.config import DiffusionGemmaConfig
from engine.families.diffusion_gemma.kv import EncoderKV
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.kv_cache import KVCache
from engine.model import Model
from engine.packing import PackScope
from engine.parallel.group import RankGroup
from engine.parallel.loading import checkpoint_family, load_rank_model
from engine.parallel.messages import (
    CacheRef,
    Call,
    Forward,
    GemmaDenoise,
    GemmaEncode,
    LoadShard,
    PackWeights,
    ReleaseModel,
    SdarForward,
    cpu,
    describe,
)
from engine.parallel.plan import ParallelPlan, ParallelPlanError
from engine.parallel.slices import LoadedShard

_model_numbers = itertools.count()


class _CacheNumbers:
    """Rank 0's caches by number, and the numbers of those it dropped since the last call."""

    def __init__(self) -> None:
        self._numbers: dict[int, int] = {}
        self._released: list[int] = []
        self._next = itertools.count()
        self._lock = threading.Lock()

    def ref(self, cache: KVCache | EncoderKV | None) -> CacheRef | None:
        """CACHE's reference in a message (numbered on first sight)."""
        if cache is None:
            return None
        key = id(cache)
        with self._lock:
            number = self._numbers.get(key)
            if number is None:
                number = self._numbers[key] = next(self._next)
                # Runs when the cache is collected, before its id can be reused.
                weakref.finalize(cache, self._forget, key, number)
        return CacheRef(number, cache.num_slots, cache.max_seq_len, str(cache.dtype))

    def take_released(self) -> tuple[int, ...]:
        """The numbers dropped since the last call."""
        with self._lock:
            released, self._released = tuple(self._released), []
        return released

    def _forget(self, key: int, number: int) -> None:
        with self._lock:
            self._numbers.pop(key, None)
            self._released.append(number)


class RankZeroModel:
    """Rank 0's handle on a model split over GROUP; `local` is rank 0's own shard."""

    family: str

    def __init__(
        self,
        group: RankGroup,
        number: int,
        loaded: LoadedShard,
    ) -> None:
        self.group = group
        self.number = number
        self.local = loaded.model
        self.whole_config: ModelConfig | DiffusionGemmaConfig = loaded.config
        self.read_log = loaded.read_log  # what rank 0's load read
        self._caches = _CacheNumbers()
        self._closed = False

    @property
    def config(self) -> Any:
        """Rank 0's share of the config (see the module docstring)."""
        return self.local.config

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the weights."""
        return self.local.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        """Dtype of activations; logits are fp32."""
        return self.local.compute_dtype

    @property
    def device(self) -> torch.device:
        """Rank 0's device."""
        return self.local.device

    @property
    def weights_layout(self) -> str:
        """How the projection weights are held (the same on every rank)."""
        return self.local.weights_layout

    @property
    def parallel_size(self) -> int:
        """Ranks the model is split over."""
        return self.group.size

    def parameters(self) -> Iterator[nn.Parameter]:
        """Rank 0's parameters (its share)."""
        return self.local.parameters()

    def weight_bytes(self) -> int:
        """Bytes rank 0's share of the weights takes (about each rank's)."""
        return self.local.weight_bytes()

    def close(self) -> None:
        """Drops the model on the other ranks (rank 0's shard goes with this object)."""
        if not self._closed:
            self._closed = True
            with self.group.lock:
                self.group.send(ReleaseModel(self.number))

    def _call(self, forward: Forward, cache: Any, payload: Tensor | None = None) -> Any:
        """FORWARD on every rank; rank 0's result."""
        if self._closed:
            raise EngineError("the parallel model was closed")
        ref = self._caches.ref(cache)
        with self.group.lock:
            self.group.send(Call(self.number, ref, self._caches.take_released(), forward))
            return forward.run(self.local, cache, payload)


class ParallelSdarModel(RankZeroModel):
    """An SDAR-family `Model` split over the group, as its runner drives it."""

    family = "sdar"
    local: Model

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        block_size: int | Tensor = 1,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        cache_lens: Tensor | None = None,
        write_cache: bool = False,
        logits_rows: Tensor | None = None,
    ) -> Tensor:
        """`Model.forward` on every rank: the whole vocabulary's logits."""
        return self.forward(
            input_ids,
            positions,
            block_size=block_size,
            cache=cache,
            slots=slots,
            cache_lens=cache_lens,
            write_cache=write_cache,
            logits_rows=logits_rows,
        )

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor | None = None,
        *,
        block_size: int | Tensor = 1,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        cache_lens: Tensor | None = None,
        write_cache: bool = False,
        logits_rows: Tensor | None = None,
    ) -> Tensor:
        """`Model.forward` on every rank: the whole vocabulary's logits."""
        forward = SdarForward(
            input_ids=input_ids.detach().cpu(),
            positions=cpu(positions),
            block_size=block_size.cpu() if isinstance(block_size, Tensor) else block_size,
            slots=cpu(slots),
            cache_lens=cpu(cache_lens),
            write_cache=write_cache,
            logits_rows=cpu(logits_rows),
        )
        result: Tensor = self._call(forward, cache)
        return result

    @property
    def packed(self) -> bool:
        """Whether the projections are in oneDNN's layout."""
        return self.local.packed

    def pack_weights(self, scope: PackScope = "all") -> int:
        """`Model.pack_weights` on every rank; rank 0's extra bytes."""
        with self.group.lock:
            self.group.send(PackWeights(self.number, scope))
            return self.local.pack_weights(scope)

    def track_experts(self, enabled: bool = True) -> None:
        """Counts tokens per expert on rank 0 (every rank routes every token alike)."""
        self.local.track_experts(enabled)

    def expert_token_counts(self) -> Tensor:
        """(num_layers, num_experts) tokens routed to each expert since tracking began."""
        return self.local.expert_token_counts()


class ParallelGemmaModel(RankZeroModel):
    """A `DiffusionGemmaModel` split over the group, as its runner drives it (slot form)."""

    family = "diffusion-gemma"
    local: DiffusionGemmaModel

    def new_kv(self, num_slots: int, max_seq_len: int) -> EncoderKV:
        """Rank 0's part of a new encoder store (its K/V heads)."""
        return self.local.new_kv(num_slots, max_seq_len)

    def encode_into(
        self,
        kv: EncoderKV,
        ids: Tensor,
        slots: Tensor,
        cache_lens: Tensor,
        lengths: Tensor | None = None,
    ) -> None:
        """`DiffusionGemmaModel.encode_into` on every rank."""
        forward = GemmaEncode(ids.detach().cpu(), slots.cpu(), cache_lens.cpu(), cpu(lengths))
        self._call(forward, kv)

    def denoise_batch(
        self,
        kv: EncoderKV,
        canvas: Tensor,
        slots: Tensor,
        cache_lens: Tensor,
        self_conditioning_logits: Tensor | None = None,
        self_conditioning_mask: Tensor | None = None,
    ) -> Tensor:
        """`DiffusionGemmaModel.denoise_batch` on every rank: the whole vocabulary's logits.
        The self-conditioning logits go to each rank by its vocabulary columns."""
        sc = self_conditioning_logits
        if sc is not None and sc.shape != (*canvas.shape, self.whole_config.vocab_size):
            raise ValueError(
                f"self_conditioning_logits must be {(*canvas.shape, self.whole_config.vocab_size)}"
                f", got {tuple(sc.shape)}"
            )
        forward = GemmaDenoise(
            canvas=canvas.detach().cpu(),
            slots=slots.cpu(),
            cache_lens=cache_lens.cpu(),
            conditioning_dtype=None if sc is None else str(sc.dtype),
            conditioning_mask=cpu(self_conditioning_mask),
        )
        result: Tensor = self._call(forward, kv, sc)
        return result


ParallelModel = ParallelSdarModel | ParallelGemmaModel


def load_parallel_model(
    group: RankGroup,
    path: str | Path,
    plan: ParallelPlan,
    *,
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> ParallelModel:
    """Every rank of GROUP (rank 0 calls this; the others run `serve_worker`) loads its shard
    of the checkpoint at PATH under PLAN, on its own device; returns rank 0's model once every
    rank has loaded. Raises rank 0's own error (ParallelPlanError, CheckpointError, ...) or an
    EngineError naming the first rank that failed and why."""
    if not group.is_driver:
        raise RuntimeError("rank 0 loads the parallel model; the other ranks run serve_worker")
    if plan.size != group.size:
        raise ParallelPlanError(
            "parallel.size",
            f"parallel.size {plan.size} does not match the {group.size} ranks of the group",
        )
    family = checkpoint_family(path)  # a missing checkpoint fails here, before any message
    number = next(_model_numbers)
    error: BaseException | None = None
    with group.lock:
        group.send(LoadShard(number, str(path), plan, dtype, compute_dtype))
        try:
            loaded = load_rank_model(
                path, plan.share(0), device=group.device, dtype=dtype, compute_dtype=compute_dtype
            )
        except Exception as exc:  # reported after every rank's outcome is in
            error = exc
        outcomes = group.gather_outcomes(None if error is None else describe(error))
    failed = [(rank, why) for rank, why in enumerate(outcomes) if why is not None]
    if failed:
        with group.lock:
            group.send(ReleaseModel(number))
        if error is not None:
            raise error
        rank, why = failed[0]
        raise EngineError(f"rank {rank} of {group.size} could not load its shard: {why}")
    if family == "diffusion-gemma":
        return ParallelGemmaModel(group, number, loaded)
    return ParallelSdarModel(group, number, loaded)
