"""A rank's shard of any family's checkpoint: the one place that branches on the family."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import read_checkpoint_json
from engine.errors import CheckpointError
from engine.families.registry import family_of
from engine.parallel.plan import RankShare
from engine.parallel.slices import LoadedShard


def checkpoint_family(path: str | Path) -> str:
    """The family of the checkpoint at PATH, from its config.json (CheckpointError if none)."""
    source = Path(path) / "config.json"
    if not source.is_file():
        raise CheckpointError(f"{source}: missing; a checkpoint needs config.json")
    return family_of(read_checkpoint_json(source), source=str(source))


def load_rank_model(
    path: str | Path,
    share: RankShare,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> LoadedShard:
    """SHARE's rank of the checkpoint at PATH, whichever family it is."""
    family = checkpoint_family(path)
    if family == "diffusion-gemma":
        from engine.parallel.gemma_shard import load_gemma_shard

        return load_gemma_shard(
            path, share, device=device, dtype=dtype, compute_dtype=compute_dtype
        )
    if family == "sdar":
        from engine.parallel.sdar_shard import load_sdar_shard

        return load_sdar_shard(path, share, device=device, dtype=dtype, compute_dtype=compute_dtype)
    raise CheckpointError(f"{path}: the {family} family cannot run on several ranks yet")
