"""`parallel` in the engine config: the section, its flags (`dctl engine serve --parallel N
--experts ...`), the rule a model's split obeys, and what one rank needs of a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from engine.serve import read_config
from protocol.engine_config import (
    MAX_PARALLEL_SIZE,
    ParallelConfig,
    ServeConfigError,
    load_serve_config,
    validate_deployment_config,
)
from protocol.parallel_split import parallel_split_problem
from protocol.rest import MAX_GPUS_PER_INSTANCE
from protocol.wire import MemoryPlan

GIB = 2**30


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    """A directory the config accepts as a checkpoint (nothing is loaded)."""
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_by_default_one_rank_per_gpu_and_experts_placed_whole(checkpoint: Path) -> None:
    config = load_serve_config(None, {"model.path": str(checkpoint)})
    assert config.parallel == ParallelConfig(size=None, experts="expert")
    assert MAX_PARALLEL_SIZE == MAX_GPUS_PER_INSTANCE  # a rank per GPU an instance may have


def test_the_serve_flags_reach_the_config(checkpoint: Path) -> None:
    argv = ["--model", str(checkpoint), "--parallel", "4", "--experts", "tensor"]
    config = read_config(argv, prog="dctl engine serve")
    assert config.parallel == ParallelConfig(size=4, experts="tensor")
    assert read_config([*argv[:2], "--parallel", "null"]).parallel.size is None


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--parallel", "0"], "flags: parallel.size: Input should be greater than or equal to 1"),
        (["--parallel", "65"], "parallel.size: Input should be less than or equal to 64"),
        (["--parallel", "two"], "parallel.size"),
        (["--experts", "data"], "parallel.experts: Input should be 'expert' or 'tensor'"),
    ],
)
def test_dctl_engine_serve_refuses_a_bad_parallel_flag_naming_the_key(
    checkpoint: Path, flags: list[str], needle: str
) -> None:
    result = CliRunner().invoke(app, ["engine", "serve", "--model", str(checkpoint), *flags])
    assert result.exit_code == 2
    assert needle in result.output


def test_a_file_naming_an_unknown_parallel_key_is_refused(tmp_path: Path, checkpoint: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(f"model: {{path: {checkpoint}}}\nparallel: {{sise: 2}}\n")
    with pytest.raises(ServeConfigError, match=r"unknown key 'parallel.sise' .*size, experts"):
        load_serve_config(path)


def test_a_deployment_sets_the_parallel_section() -> None:
    config = {"parallel": {"size": 2, "experts": "tensor"}}
    assert validate_deployment_config(config) == config
    with pytest.raises(ServeConfigError, match=r"engine_config: parallel.experts"):
        validate_deployment_config({"parallel": {"experts": "pipeline"}})


@pytest.mark.parametrize(
    ("size", "experts", "figures", "problem"),
    [
        (1, "expert", {"num_heads": 7, "kv_heads": [3], "num_experts": 5}, None),
        (4, "expert", {"num_heads": 8, "kv_heads": [8], "num_experts": 16}, None),
        # Fewer K/V heads than ranks: each is replicated on size / K/V heads ranks.
        (4, "expert", {"num_heads": 8, "kv_heads": [2, 1], "num_experts": 8}, None),
        (4, "expert", {"num_heads": 6}, "does not divide the 6 attention heads of m"),
        (4, "expert", {"num_heads": 12, "kv_heads": [8, 6]}, "the 6 K/V heads of m"),
        (4, "expert", {"num_heads": 12, "kv_heads": [3]}, "the 3 K/V heads of m"),
        (4, "expert", {"num_heads": 8, "num_experts": 6}, "does not divide the 6 experts of m"),
        # Experts split each across every rank: their count no longer matters; dense: none.
        (4, "tensor", {"num_heads": 8, "num_experts": 6}, None),
        (4, "expert", {"num_heads": 8, "num_experts": 0}, None),
        (3, "expert", {}, None),  # nothing known: nothing to check
    ],
)
def test_a_model_splits_when_its_heads_and_experts_divide_by_the_ranks(
    size: int, experts: str, figures: dict[str, object], problem: str | None
) -> None:
    found = parallel_split_problem(size, experts, model="m", **figures)  # type: ignore[arg-type]
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found and f"parallel.size {size}" in found


def test_one_rank_holds_its_share_of_weights_and_kv_and_all_activations() -> None:
    plan = MemoryPlan(
        weights_bytes=8 * GIB, activation_bytes=GIB, kv_bytes_per_token=1024, num_kv_heads=[8]
    )
    assert plan.rank_bytes(2**20, 1) == plan.required_bytes(2**20) == 10 * GIB
    assert plan.rank_bytes(2**20, 4) == 2 * GIB + GIB + GIB // 4
    # More ranks than K/V heads: a rank holds one head of each layer, replicated.
    assert plan.rank_bytes(2**20, 16) == GIB // 2 + GIB + GIB // 8
    # Counts not stored (a version registered earlier): the KV cache splits like the weights.
    unknown = MemoryPlan(weights_bytes=8 * GIB, kv_bytes_per_token=1024)
    assert unknown.rank_bytes(2**20, 16) == GIB // 2 + GIB // 16
