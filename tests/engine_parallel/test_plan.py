"""The rules a parallel plan holds a model to, and each rank's share (torch-free)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.config import ModelConfig
from engine.parallel.plan import ModelDims, ParallelPlan, ParallelPlanError, Span

# Qwen3-30B-A3B's figures (SDAR-30B-A3B): 32 heads over 4 K/V heads, 128 experts.
QWEN3_MOE = ModelDims(
    num_heads=32,
    kv_heads=(4,),
    intermediate_size=6144,
    num_experts=128,
    moe_intermediate_size=768,
    vocab_size=151936,
)
# DiffusionGemma 26B-A4B-like: 16 heads, 8 K/V heads in sliding layers, 2 in full ones.
GEMMA = replace(QWEN3_MOE, num_heads=16, kv_heads=(8, 2), num_experts=128, vocab_size=262144)


@pytest.mark.parametrize(
    ("plan", "dims"),
    [
        (ParallelPlan(1), QWEN3_MOE),
        (ParallelPlan(2, "expert"), QWEN3_MOE),
        (ParallelPlan(8, "tensor"), QWEN3_MOE),  # 8 ranks replicate each of the 4 K/V heads
        (ParallelPlan(4, "expert"), GEMMA),  # full layers' 2 K/V heads each on 2 ranks
        (ParallelPlan(3, "expert"), replace(QWEN3_MOE, num_heads=6, kv_heads=(3,), num_experts=6,
                                             intermediate_size=6)),  # vocab not divisible by 3
    ],
)  # fmt: skip
def test_plans_that_split_the_model_pass(plan: ParallelPlan, dims: ModelDims) -> None:
    plan.check_dims(dims)


@pytest.mark.parametrize(
    ("plan", "dims", "key", "figures"),
    [
        (ParallelPlan(3), QWEN3_MOE, "parallel.size", ["3", "num_attention_heads (32)"]),
        (ParallelPlan(6), GEMMA, "parallel.size", ["6", "num_attention_heads (16)"]),
        (ParallelPlan(4), replace(QWEN3_MOE, kv_heads=(6,), num_heads=24), "parallel.size",
         ["4", "num_key_value_heads (6)"]),
        (ParallelPlan(4), replace(QWEN3_MOE, intermediate_size=6146), "parallel.size",
         ["4", "intermediate_size (6146)"]),
        (ParallelPlan(16, "expert"), replace(QWEN3_MOE, num_experts=60), "parallel.experts",
         ["16", "num_experts (60)"]),
        (ParallelPlan(4, "tensor"), replace(QWEN3_MOE, moe_intermediate_size=1410),
         "parallel.experts", ["4", "moe_intermediate_size (1410)"]),
        (ParallelPlan(4), replace(QWEN3_MOE, vocab_size=6), "parallel.size",
         ["4", "vocab_size 6"]),
        (ParallelPlan(0), QWEN3_MOE, "parallel.size", ["0"]),
        (ParallelPlan(2, "pipeline"), QWEN3_MOE, "parallel.experts",  # type: ignore[arg-type]
         ["'pipeline'", "expert, tensor"]),
    ],
)  # fmt: skip
def test_a_plan_the_model_cannot_take_names_the_key_and_the_figures(
    plan: ParallelPlan, dims: ModelDims, key: str, figures: list[str]
) -> None:
    with pytest.raises(ParallelPlanError) as caught:
        plan.check_dims(dims)
    assert caught.value.field == key
    message = str(caught.value)
    assert message.startswith(key)
    for figure in figures:
        assert figure in message


def test_a_dense_model_has_no_expert_rule() -> None:
    ParallelPlan(4, "expert").check_dims(replace(QWEN3_MOE, num_experts=0))


def test_dims_of_an_sdar_config_count_dense_layers_and_experts() -> None:
    config = ModelConfig.from_hf(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 100,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "moe_intermediate_size": 30,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "mlp_only_layers": [0],
        }
    )
    dims = ModelDims.of(config)
    assert dims == ModelDims(8, (2,), 96, 6, 30, 100)
    with pytest.raises(ParallelPlanError, match="moe_intermediate_size \\(30\\)"):
        ParallelPlan(4, "tensor").check(config)
    with pytest.raises(ParallelPlanError, match="num_experts \\(6\\)"):
        ParallelPlan(4, "expert").check(config)
    ParallelPlan(2, "tensor").check(config)


@pytest.mark.parametrize(
    ("size", "rank", "kv_heads", "span"),
    [(2, 1, 4, Span(2, 2)), (4, 1, 2, Span(0, 1)), (4, 2, 2, Span(1, 1)), (8, 7, 2, Span(1, 1))],
)
def test_a_rank_holds_the_kv_heads_its_query_heads_read(
    size: int, rank: int, kv_heads: int, span: Span
) -> None:
    heads = 16
    share = ParallelPlan(size).share(rank)
    assert share.kv_heads(kv_heads) == span
    group = heads // kv_heads  # query heads per K/V head
    queries = share.even(heads)
    assert {q // group for q in range(queries.start, queries.stop)} == set(
        range(span.start, span.stop)
    )


def test_vocabulary_rows_cover_the_vocabulary_once_the_last_rank_short() -> None:
    plan = ParallelPlan(4)
    spans = [plan.share(r).vocab(322) for r in range(4)]
    assert spans == [Span(0, 81), Span(81, 81), Span(162, 81), Span(243, 79)]


def test_experts_are_whole_or_split_by_columns() -> None:
    expert, tensor = ParallelPlan(4, "expert").share(3), ParallelPlan(4, "tensor").share(3)
    assert (expert.experts(8), expert.expert_columns(32)) == (Span(6, 2), Span(0, 32))
    assert (tensor.experts(8), tensor.expert_columns(32)) == (Span(0, 8), Span(24, 8))
