"""Whether a model splits over the ranks of one instance: the rule `deploy create/configure`
and the engine's start-up both apply (`parallel` in the engine config)."""

from __future__ import annotations

from collections.abc import Sequence


def parallel_split_problem(
    size: int,
    experts: str,
    *,
    model: str,
    num_heads: int | None = None,
    kv_heads: Sequence[int] = (),
    num_experts: int | None = None,
) -> str | None:
    """Why MODEL cannot be split over SIZE ranks, naming the key and the figures; None if it can.

    The rule: the attention heads divide by `size`; each layer's K/V heads divide by it or
    divide it (fewer K/V heads than ranks are replicated, size / K/V ranks sharing each); with
    `experts: expert` the routed experts divide by it. A figure left None (unknown) is not
    checked; KV_HEADS holds each distinct per-layer count (DiffusionGemma's layers differ).
    """
    if size == 1:
        return None
    if num_heads is not None and num_heads % size:
        return (
            f"parallel.size {size} does not divide the {num_heads} attention heads of {model} "
            f"(each rank computes heads / size of them): choose a size that divides {num_heads}"
        )
    for kv in sorted(set(kv_heads)):
        if kv % size and size % kv:
            return (
                f"parallel.size {size} and the {kv} K/V heads of {model}: one must divide the "
                f"other (K/V heads are split across the ranks, or each is replicated on "
                f"size / K/V heads ranks)"
            )
    if experts == "expert" and num_experts and num_experts % size:
        return (
            f"parallel.size {size} does not divide the {num_experts} experts of {model} with "
            f"parallel.experts 'expert' (each rank holds experts / size of them whole): choose a "
            f"size that divides {num_experts}, or parallel.experts: tensor"
        )
    return None
