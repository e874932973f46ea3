"""Each rank reads only its slices of the checkpoint: about 1/N of the weights plus the parts
every rank holds whole, and never a whole tensor it holds a part of. (Loading needs no process
group: these run every rank's load in this process.)"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from engine.loader import _checkpoint_headers, load_model
from engine.parallel import slices
from engine.parallel.loading import load_rank_model
from engine.parallel.plan import ExpertPlacement, ParallelPlan
from engine.parallel.slices import LoadedShard

# Tensors a rank needs whole: norms and scales (1-D), routers, the K/V projections of layers
# with fewer K/V heads than ranks (each head is replicated), and in `expert` placement the
# per-expert tensors of the rank's own experts.
ROUTERS = ("mlp.gate.weight", "router.proj.weight")
PER_EXPERT = re.compile(r"\.experts\.\d+\.")
LAYER = re.compile(r"layers\.(\d+)\.")


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if "scalars" in n)]
    return sum(t.numel() * t.element_size() for t in tensors)


def needed_whole(name: str, shape: tuple[int, ...], shard: LoadedShard, plan: ParallelPlan) -> bool:
    layer = LAYER.search(name)
    kv_heads = shard.config.num_kv_heads
    if layer is not None and not isinstance(kv_heads, int):
        kv_heads = kv_heads[int(layer.group(1))]
    return (
        len(shape) == 1
        or name.endswith(ROUTERS)
        or (name.endswith(("k_proj.weight", "v_proj.weight")) and kv_heads < plan.size)
        or (plan.experts == "expert" and PER_EXPERT.search(name) is not None)
    )


@pytest.mark.parametrize("experts", ["expert", "tensor"])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", ["sdar", "dg"])
def test_a_rank_reads_its_share_and_no_whole_tensor_it_splits(
    family: str, size: int, experts: ExpertPlacement, sdar_dir: Path, dg_dir: Path
) -> None:
    path = sdar_dir if family == "sdar" else dg_dir
    headers = _checkpoint_headers(path)
    whole = weight_bytes(load_model(path))
    plan = ParallelPlan(size, experts)
    shards: list[LoadedShard] = [load_rank_model(path, plan.share(r)) for r in range(size)]
    replicated = []  # per rank: bytes of the tensors it read whole and every rank holds
    for rank, shard in enumerate(shards):
        log = shard.read_log
        # A rank reads exactly what it holds (a row-parallel bias it does not add is zeroed).
        assert log.bytes_read + log.bytes_zeroed == weight_bytes(shard.model), rank
        read_whole = [(n, s) for n, s in log.reads if s == headers[n].shape]
        assert all(needed_whole(n, s, shard, plan) for n, s in read_whole), read_whole
        replicated.append(
            sum(torch.Size(s).numel() * 4 for n, s in read_whole if not PER_EXPERT.search(n))
        )
        # About 1/N of the rest (K/V heads replicated over 4 ranks and the vocabulary's
        # padding add a little).
        share = (whole - replicated[0]) / size
        assert log.bytes_read - replicated[-1] <= 1.1 * share, (rank, log.bytes_read, share)
    if size == 2:
        # Together the ranks read every split tensor once.
        split = sum(s.read_log.bytes_read for s in shards) - sum(replicated)
        assert split + replicated[0] == whole


def test_embedding_rows_are_read_by_vocabulary_share(sdar_dir: Path) -> None:
    plan = ParallelPlan(4, "expert")
    shapes = [
        load_rank_model(sdar_dir, plan.share(r)).read_log.shapes("model.embed_tokens.weight")
        for r in range(4)
    ]
    assert shapes == [[(81, 64)], [(81, 64)], [(81, 64)], [(79, 64)]]


def test_a_file_reopened_after_every_read_loads_the_same_shard(
    sdar_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    share = ParallelPlan(2, "tensor").share(1)
    usual = load_rank_model(sdar_dir, share).model.state_dict()
    # A window smaller than any tensor: the map is reopened for every read, so no more than
    # one tensor's pages are ever mapped at once.
    monkeypatch.setattr(slices, "MAPPED_WINDOW", 1)
    reopened = load_rank_model(sdar_dir, share).model.state_dict()
    assert usual.keys() == reopened.keys()
    assert all(torch.equal(usual[k], reopened[k]) for k in usual)


def stacked_copy(source: Path, target: Path) -> Path:
    """SOURCE's checkpoint with its experts stacked (`mlp.experts.gate_up_proj` /
    `down_proj`, the transformers 5 layout) instead of one tensor per expert."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    for prefix in sorted({n.split("experts.")[0] for n in tensors if ".experts." in n}):
        count = sum(1 for n in tensors if n.startswith(prefix) and n.endswith("down_proj.weight"))
        part = [f"{prefix}experts.{e}." for e in range(count)]
        gate = [tensors.pop(p + "gate_proj.weight") for p in part]
        up = [tensors.pop(p + "up_proj.weight") for p in part]
        gate_up = [torch.cat(pair) for pair in zip(gate, up, strict=True)]
        down = [tensors.pop(p + "down_proj.weight") for p in part]
        tensors[prefix + "experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[prefix + "experts.down_proj"] = torch.stack(down)
    save_file(tensors, str(target / "model.safetensors"), {"format": "pt"})
    return target


@pytest.mark.parametrize("experts", ["expert", "tensor"])
def test_stacked_experts_give_a_rank_the_same_weights_as_per_expert_tensors(
    sdar_dir: Path, tmp_path: Path, experts: ExpertPlacement
) -> None:
    stacked = stacked_copy(sdar_dir, tmp_path / "stacked")
    share = ParallelPlan(4, experts).share(2)
    per_expert = load_rank_model(sdar_dir, share).model.state_dict()
    from_stacked = load_rank_model(stacked, share)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in from_stacked.read_log.reads)
    weights = from_stacked.model.state_dict()
    assert all(torch.equal(per_expert[k], weights[k]) for k in per_expert)
