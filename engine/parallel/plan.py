"""How a model splits over N ranks: the plan, its rules against a model config, each rank's share.

Torch-free: the control plane and `dctl` validate a deployment's `parallel` settings with it
before anything is loaded, and the messages of `ParallelPlanError` are what they answer (422).

The rules (each rank holds a contiguous span of everything it splits):
- attention: query heads split evenly (`num_attention_heads` divisible by N). K/V heads split
  evenly when N divides them; when there are fewer K/V heads than ranks, N must be a multiple
  of them and each K/V head is replicated on N / KV ranks, the ranks whose query heads use it
  (so a rank always holds exactly the K/V heads its queries read). Per layer for models whose
  layers differ (DiffusionGemma's full-attention layers).
- dense MLPs (and DiffusionGemma's self-conditioning MLP): the intermediate size splits evenly.
- routed experts, `experts: expert`: each rank holds num_experts / N whole experts (N must
  divide num_experts); `experts: tensor`: every rank holds every expert, each expert's
  intermediate size split evenly (N must divide moe_intermediate_size). The router is whole on
  every rank, so every rank routes every token alike.
- vocabulary (embeddings, LM head): ceil(V / N) rows per rank, the last rank fewer when N does
  not divide V (gathered logits are cut back to V), so any vocabulary splits; every rank must
  hold at least one row.
- norms, routers, per-expert scales and layer scalars are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from engine.errors import InvalidParams

if TYPE_CHECKING:
    from engine.config import ModelConfig
    from engine.families.diffusion_gemma.config import DiffusionGemmaConfig

ExpertPlacement = Literal["expert", "tensor"]
EXPERT_PLACEMENTS: tuple[str, ...] = get_args(ExpertPlacement)


class ParallelPlanError(InvalidParams):
    """A parallel plan the model cannot be split by; `field` is the plan's key
    (`parallel.size` or `parallel.experts`) and the message names the model's figures."""


@dataclass(frozen=True)
class Span:
    """A contiguous [start, start + count) range of heads, rows, columns or experts."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        """One past the last index."""
        return self.start + self.count

    def scaled(self, width: int) -> Span:
        """The span in units WIDTH times smaller (heads -> rows of head_dim each)."""
        return Span(self.start * width, self.count * width)


@dataclass(frozen=True)
class ModelDims:
    """The figures of a model that a plan splits, in the plan's words."""

    num_heads: int
    kv_heads: tuple[int, ...]  # per layer
    intermediate_size: int  # dense MLPs; 0 when the model has none
    num_experts: int  # 0 for a dense model
    moe_intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, config: ModelConfig | DiffusionGemmaConfig) -> ModelDims:
        """The dims of an SDAR-family `ModelConfig` or a `DiffusionGemmaConfig`."""
        kv = config.num_kv_heads
        if isinstance(kv, int):  # SDAR: one K/V head count for every layer
            moe = config.num_experts if config.is_moe else 0  # type: ignore[union-attr]
            dense = any(
                not config.is_moe_layer(i)  # type: ignore[union-attr]
                for i in range(config.num_layers)
            )
            return cls(
                num_heads=config.num_heads,
                kv_heads=(kv,),
                intermediate_size=config.intermediate_size if dense else 0,
                num_experts=moe,
                moe_intermediate_size=config.moe_intermediate_size if moe else 0,
                vocab_size=config.vocab_size,
            )
        return cls(
            num_heads=config.num_heads,
            kv_heads=tuple(kv),
            intermediate_size=config.intermediate_size,
            num_experts=config.num_experts,
            moe_intermediate_size=config.moe_intermediate_size,
            vocab_size=config.vocab_size,
        )


@dataclass(frozen=True)
class ParallelPlan:
    """N ranks for one model instance, and how its routed experts are placed on them."""

    size: int
    experts: ExpertPlacement = "expert"

    def check(self, config: ModelConfig | DiffusionGemmaConfig) -> None:
        """Raises ParallelPlanError (naming the key and the figures) unless CONFIG's model splits
        by this plan under the rules of the module docstring."""
        self.check_dims(ModelDims.of(config))

    def check_dims(self, dims: ModelDims) -> None:
        """`check` on a model's dims."""
        n = self.size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParallelPlanError(
                "parallel.size", f"parallel.size must be a whole number >= 1, got {n!r}"
            )
        if self.experts not in EXPERT_PLACEMENTS:
            raise ParallelPlanError(
                "parallel.experts",
                f"parallel.experts must be one of {', '.join(EXPERT_PLACEMENTS)}, "
                f"got {self.experts!r}",
            )
        if dims.num_heads % n:
            raise ParallelPlanError(
                "parallel.size",
                f"parallel.size {n} does not divide num_attention_heads ({dims.num_heads}): "
                f"each rank holds an equal share of the heads; use a size that divides "
                f"{dims.num_heads}",
            )
        for kv in sorted(set(dims.kv_heads)):
            if kv % n and n % kv:
                raise ParallelPlanError(
                    "parallel.size",
                    f"parallel.size {n} does not fit num_key_value_heads ({kv}): the size must "
                    f"divide the K/V heads, or be a multiple of them (each K/V head then "
                    f"replicated on size / {kv} ranks)",
                )
        if dims.intermediate_size % n:
            raise ParallelPlanError(
                "parallel.size",
                f"parallel.size {n} does not divide intermediate_size "
                f"({dims.intermediate_size}) of the dense MLP",
            )
        if dims.num_experts and self.experts == "expert" and dims.num_experts % n:
            raise ParallelPlanError(
                "parallel.experts",
                f"parallel.experts 'expert' places whole experts on ranks: parallel.size {n} "
                f"must divide num_experts ({dims.num_experts}); use experts 'tensor' or "
                "another size",
            )
        if dims.num_experts and self.experts == "tensor" and dims.moe_intermediate_size % n:
            raise ParallelPlanError(
                "parallel.experts",
                f"parallel.experts 'tensor' splits every expert: parallel.size {n} must divide "
                f"moe_intermediate_size ({dims.moe_intermediate_size}); use experts 'expert' "
                "or another size",
            )
        rows = -(-dims.vocab_size // n)
        if rows * (n - 1) >= dims.vocab_size:
            raise ParallelPlanError(
                "parallel.size",
                f"parallel.size {n} leaves a rank without vocabulary rows (vocab_size "
                f"{dims.vocab_size}, {rows} rows per rank)",
            )

    def share(self, rank: int) -> RankShare:
        """What RANK holds under this plan."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a plan of {self.size} ranks")
        return RankShare(self, rank)


@dataclass(frozen=True)
class RankShare:
    """One rank's span of each split dimension (the rules of the module docstring)."""

    plan: ParallelPlan
    rank: int

    @property
    def size(self) -> int:
        """Ranks in the plan."""
        return self.plan.size

    def even(self, total: int) -> Span:
        """This rank's equal part of TOTAL (heads, intermediate columns)."""
        part = total // self.size
        return Span(self.rank * part, part)

    def kv_heads(self, total: int) -> Span:
        """The K/V heads this rank's query heads read: an equal part, or the one head it
        shares with size / total other ranks when there are fewer heads than ranks."""
        if total % self.size == 0:
            return self.even(total)
        return Span(self.rank * total // self.size, 1)

    def vocab(self, total: int) -> Span:
        """This rank's vocabulary rows: ceil(total / size) of them, fewer on the last ranks."""
        rows = -(-total // self.size)
        start = min(self.rank * rows, total)
        return Span(start, min(rows, total - start))

    def experts(self, total: int) -> Span:
        """The routed experts whose weights this rank holds."""
        return self.even(total) if self.plan.experts == "expert" else Span(0, total)

    def expert_columns(self, total: int) -> Span:
        """This rank's columns of each held expert's intermediate size."""
        return self.even(total) if self.plan.experts == "tensor" else Span(0, total)
