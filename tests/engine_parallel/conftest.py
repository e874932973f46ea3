"""Tiny checkpoints that split over 2 and 4 ranks, and groups of ranks on this machine (gloo).

Checkpoints (session scope, built once per pytest process):
- `sdar_dir`: a Qwen3-MoE (transformers' own classes): 8 query heads over 2 K/V heads (2 ranks
  split them, 4 ranks replicate each on 2 ranks), 8 experts top-2, layer 0 a dense MLP,
  attention biases (the output bias is added once, by rank 0), a vocabulary of 322 that no
  split divides evenly (the last rank's rows are padded when gathered);
- `dg_dir`: the DiffusionGemma demo (`create_diffusion_gemma_demo`): 4 heads over 2 K/V heads
  in sliding layers and 1 (replicated) in full ones of another head size, 4 experts top-2
  beside the dense MLP, a self-conditioning MLP, a tied soft-capped head;
- `sdar_peaked_dir` / `dg_tempered_dir`: the same with decisions far from float noise (the
  LM head scaled up, as `tests/engine/decoding_fixtures.py` does; the residual branches scaled
  down, as `tests/engine/diffusion_gemma/test_engine.py` does), so that tokens compare exactly
  while a parallel model's sums run in another order.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.parallel.launcher import LocalGroup, start_local_group

SDAR_VOCAB = 322
SDAR_OVERRIDES = {
    "vocab_size": SDAR_VOCAB,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "mlp_only_layers": [0],
    "attention_bias": True,
}
LM_HEAD_SCALE = 100.0
BRANCH_SCALE = 0.2


def rescaled_copy(source: Path, target: Path, factors: dict[str, float]) -> Path:
    """A copy of checkpoint SOURCE at TARGET whose tensors named `*SUFFIX` are multiplied by
    FACTORS[SUFFIX]."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        tensors = load_file(file)
        for name in tensors:
            for suffix, factor in factors.items():
                if name.endswith(suffix):
                    tensors[name] = tensors[name] * factor
        save_file(tensors, str(file), {"format": "pt"})
    return target


@pytest.fixture(scope="session")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SDAR checkpoint (module docstring)."""
    from tests.engine.conftest import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("parallel-sdar")
    return build_tiny_checkpoint(root / "sdar", config_overrides=SDAR_OVERRIDES)


@pytest.fixture(scope="session")
def sdar_peaked_dir(sdar_dir: Path) -> Path:
    """`sdar_dir` with its LM head scaled by LM_HEAD_SCALE."""
    return rescaled_copy(sdar_dir, sdar_dir.with_name("peaked"), {"lm_head.weight": LM_HEAD_SCALE})


@pytest.fixture(scope="session")
def dg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The DiffusionGemma demo checkpoint."""
    from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo

    return create_diffusion_gemma_demo(tmp_path_factory.mktemp("parallel-dg") / "dg")


@pytest.fixture(scope="session")
def dg_tempered_dir(dg_dir: Path) -> Path:
    """`dg_dir` with its residual branches scaled by BRANCH_SCALE."""
    factors = {
        ".post_attention_layernorm.weight": BRANCH_SCALE,
        ".post_feedforward_layernorm.weight": BRANCH_SCALE,
        "self_conditioning.down_proj.weight": BRANCH_SCALE,
    }
    return rescaled_copy(dg_dir, dg_dir.with_name("tempered"), factors)


@pytest.fixture(scope="module")
def rank_zero_thread() -> Iterator[None]:
    """This process is rank 0: one torch thread, as each worker rank has, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def local_group(size: int) -> Iterator[LocalGroup]:
    """A group of SIZE ranks on this machine (this process rank 0), closed afterwards."""
    group = start_local_group(size, threads=1, timeout_s=60)
    try:
        yield group
    finally:
        group.close()
