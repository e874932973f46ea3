"""One model instance over N ranks on `torch.distributed`: tensor-parallel attention, dense MLPs,
embeddings and LM head; routed experts placed whole on ranks or split (`plan`).

Rank 0 serves and schedules as a single-process engine does; the model it drives is a
`RankZeroModel` (`load_parallel_model`) that sends each forward to the other ranks, which run
`serve_worker` until rank 0 stops them. The modules:
- `plan`: `ParallelPlan` and its rules against a model (torch-free), each rank's share;
- `group`: joining the process group from the torchrun-style environment, its timeouts;
- `launcher`: a group on this machine (this process rank 0, workers as subprocesses);
- `rank_config`, `collectives`: a rank's config and its `DistributedShard` (the model seam);
- `slices`, `sdar_shard`, `gemma_shard`, `loading`: a rank's slices of a checkpoint;
- `messages`, `driver`, `worker`: the step protocol.

Public names load on first use (PEP 562), so `engine.parallel.plan` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY: dict[str, str] = {
    "ParallelPlan": "engine.parallel.plan",
    "ParallelPlanError": "engine.parallel.plan",
    "RankShare": "engine.parallel.plan",
    "RankGroup": "engine.parallel.group",
    "join_group": "engine.parallel.group",
    "LocalGroup": "engine.parallel.launcher",
    "start_local_group": "engine.parallel.launcher",
    "RankZeroModel": "engine.parallel.driver",
    "ParallelSdarModel": "engine.parallel.driver",
    "ParallelGemmaModel": "engine.parallel.driver",
    "load_parallel_model": "engine.parallel.driver",
    "serve_worker": "engine.parallel.worker",
    "load_rank_model": "engine.parallel.loading",
}

if TYPE_CHECKING:
    from engine.parallel.driver import (
        ParallelGemmaModel,
        ParallelSdarModel,
        RankZeroModel,
        load_parallel_model,
    )
    from engine.parallel.group import RankGroup, join_group
    from engine.parallel.launcher import LocalGroup, start_local_group
    from engine.parallel.loading import load_rank_model
    from engine.parallel.plan import ParallelPlan, ParallelPlanError, RankShare
    from engine.parallel.worker import serve_worker


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "LocalGroup",
    "ParallelGemmaModel",
    "ParallelPlan",
    "ParallelPlanError",
    "ParallelSdarModel",
    "RankGroup",
    "RankShare",
    "RankZeroModel",
    "join_group",
    "load_parallel_model",
    "load_rank_model",
    "serve_worker",
    "start_local_group",
]
