"""Our model against transformers' own Qwen3 / Qwen3-MoE: same checkpoint, same logits.

Each case saves a random tiny transformers model with `save_pretrained`, loads it back with
`engine.load_model`, and compares fp32 logits (max abs diff <= 1e-4):
- causal (block_size=1) against transformers' plain forward;
- block-causal (block_size=B) against transformers given the equivalent 4-D additive attention
  mask (transformers 5 passes a 4-D mask through unchanged to the eager attention, which adds it
  to the scores);
- KV cache: blocks computed against a cache of the earlier blocks equal the full forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kv_cache import KVCache
from engine.loader import load_model
from engine.model import Model, default_compute_dtype, vocab_logits
from tests.engine.conftest import build_tiny_checkpoint

TOL = 1e-4


@dataclass
class Case:
    """One architecture variant under test."""

    name: str
    dense: bool = False
    overrides: dict[str, Any] | None = None
    shard: str | None = None


CASES = [
    # GQA 2:1, untied head, renormalised top-k.
    Case("moe-gqa2-untied-norm"),
    # MHA, tied head, raw top-k probabilities, q/k/v/o biases.
    Case(
        "moe-mha-tied-rawtopk-bias",
        overrides={
            "num_key_value_heads": 4,
            "tie_word_embeddings": True,
            "norm_topk_prob": False,
            "attention_bias": True,
        },
    ),
    # GQA 4:1, MoE every 2nd layer, layer 3 forced dense; sharded checkpoint.
    Case(
        "moe-gqa4-sparse2-mlponly-sharded",
        overrides={
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_hidden_layers": 4,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
            "num_experts_per_tok": 3,
        },
        shard="30KB",
    ),
    # mlp_only_layers with sparse step 1.
    Case("moe-mlponly-step1", overrides={"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    # Dense Qwen3 (the SDAR-1.7B/4B/8B layout), GQA 4:1, tied head.
    Case(
        "dense-gqa4-tied",
        dense=True,
        overrides={"num_attention_heads": 8, "num_key_value_heads": 2, "tie_word_embeddings": True},
    ),
]


@dataclass
class Pair:
    """Our loaded model and the transformers model it was saved from."""

    ours: Model
    ref: Any
    path: Path


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pair:
    case: Case = request.param
    path = build_tiny_checkpoint(
        tmp_path_factory.mktemp(case.name),
        dense=case.dense,
        config_overrides=case.overrides,
        max_shard_size=case.shard,
        seed=CASES.index(case),
        with_tokenizer=False,
    )
    if case.shard is not None:
        assert (path / "model.safetensors.index.json").is_file()
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    return Pair(load_model(path), ref, path)


def block_causal_additive(t: int, block: int) -> torch.Tensor:
    """(1, 1, t, t) float mask: 0 where key block <= query block, -inf-like elsewhere."""
    blocks = torch.arange(t) // block
    allowed = blocks.view(1, -1) <= blocks.view(-1, 1)
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask.view(1, 1, t, t)


def ref_logits(ref: Any, ids: torch.Tensor, block: int = 1) -> torch.Tensor:
    with torch.no_grad():
        if block == 1:
            return ref(ids).logits.float()
        mask = block_causal_additive(ids.shape[1], block).expand(ids.shape[0], 1, -1, -1)
        return ref(ids, attention_mask=mask).logits.float()


def random_ids(pair: Pair, n: int, t: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, pair.ours.config.vocab_size, (n, t), generator=gen)


def test_causal_logits_match_transformers(pair: Pair) -> None:
    ids = random_ids(pair, 2, 13)
    ours = pair.ours(ids, block_size=1)
    assert ours.shape == (2, 13, pair.ours.config.vocab_size)
    assert (ours - ref_logits(pair.ref, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("block", [2, 4, 5])
def test_block_causal_logits_match_transformers_with_4d_mask(pair: Pair, block: int) -> None:
    ids = random_ids(pair, 2, 13, seed=block)
    ours = pair.ours(ids, block_size=block)
    expected = ref_logits(pair.ref, ids, block)
    assert (ours - expected).abs().max().item() <= TOL
    # The mask must matter: block-causal logits differ from causal ones inside a block.
    assert (ours - pair.ours(ids, block_size=1)).abs().max().item() > 1e-3


def test_last_block_against_cache_equals_full_forward(pair: Pair) -> None:
    block, t = 4, 12
    ids = random_ids(pair, 1, t, seed=7)
    full = pair.ours(ids, block_size=block)
    cfg = pair.ours.config
    cache = KVCache(cfg, num_slots=3, max_seq_len=32)
    slot = torch.tensor([2])
    # Prefill the first two blocks into slot 2, then run the last block against them.
    pair.ours(
        ids[:, :8],
        block_size=block,
        cache=cache,
        slots=slot,
        cache_lens=torch.tensor([0]),
        write_cache=True,
    )
    last = pair.ours(
        ids[:, 8:],
        torch.arange(8, 12).view(1, 4),
        block_size=block,
        cache=cache,
        slots=slot,
        cache_lens=torch.tensor([8]),
    )
    assert (last - full[:, 8:]).abs().max().item() <= TOL
    # Against transformers too (its block-causal forward over the whole sequence).
    assert (last - ref_logits(pair.ref, ids, block)[:, 8:]).abs().max().item() <= TOL


def test_prefill_last_row_matches_transformers_logits_to_keep(pair: Pair) -> None:
    ids = random_ids(pair, 1, 11, seed=3)
    cache = KVCache(pair.ours.config, num_slots=1, max_seq_len=16)
    last = pair.ours(
        ids,
        cache=cache,
        slots=torch.tensor([0]),
        cache_lens=torch.tensor([0]),
        write_cache=True,
        logits_rows=torch.tensor([10]),
    )
    with torch.no_grad():
        expected = pair.ref(ids, logits_to_keep=1).logits[:, -1].float()
    assert last.shape == (1, pair.ours.config.vocab_size)
    assert (last - expected).abs().max().item() <= TOL


def test_batched_rows_with_different_cache_lengths_and_block_sizes(pair: Pair) -> None:
    """Rows of one call keep their own cache length, positions and block size."""
    cfg = pair.ours.config
    seq_a, seq_b = random_ids(pair, 1, 12, seed=11), random_ids(pair, 1, 8, seed=12)
    full_a = pair.ours(seq_a, block_size=4)[0, 8:]
    full_b = pair.ours(seq_b, block_size=2)[0, 4:]
    cache = KVCache(cfg, num_slots=4, max_seq_len=32)
    for slot, seq, committed, block in ((1, seq_a, 8, 4), (3, seq_b, 4, 2)):
        pair.ours(
            seq[:, :committed],
            block_size=block,
            cache=cache,
            slots=torch.tensor([slot]),
            cache_lens=torch.tensor([0]),
            write_cache=True,
        )
    # One call: row 0 continues seq_a at 8..11 (B=4), row 1 continues seq_b at 4..7 (B=2).
    ids = torch.cat((seq_a[:, 8:], seq_b[:, 4:]))
    positions = torch.stack((torch.arange(8, 12), torch.arange(4, 8)))
    rows = torch.tensor([0, 3, 4, 6])
    out = pair.ours(
        ids,
        positions,
        block_size=torch.tensor([4, 2]),
        cache=cache,
        slots=torch.tensor([1, 3]),
        cache_lens=torch.tensor([8, 4]),
        logits_rows=rows,
    )
    expected = torch.stack((full_a[0], full_a[3], full_b[0], full_b[2]))
    assert out.shape == (4, cfg.vocab_size)
    assert (out - expected).abs().max().item() <= TOL


def test_write_cache_commits_a_block_for_later_steps(pair: Pair) -> None:
    """Committing a block (write_cache) then decoding the next one equals the full forward."""
    block = 4
    ids = random_ids(pair, 1, 12, seed=5)
    full = pair.ours(ids, block_size=block)
    cache = KVCache(pair.ours.config, num_slots=1, max_seq_len=12)
    slot = torch.tensor([0])
    for start in range(0, 12, block):
        out = pair.ours(
            ids[:, start : start + block],
            torch.arange(start, start + block).view(1, -1),
            block_size=block,
            cache=cache,
            slots=slot,
            cache_lens=torch.tensor([start]),
            write_cache=True,
        )
        assert (out - full[:, start : start + block]).abs().max().item() <= TOL


def test_expert_counts_match_transformers_routing(pair: Pair) -> None:
    cfg = pair.ours.config
    ids = random_ids(pair, 2, 9, seed=9)
    pair.ours.track_experts(True)
    try:
        before = pair.ours.expert_token_counts()
        pair.ours(ids)
        counts = pair.ours.expert_token_counts() - before
    finally:
        pair.ours.track_experts(False)
    assert counts.shape == (cfg.num_layers, cfg.num_experts)
    if not cfg.is_moe:
        assert counts.sum().item() == 0
        return
    with torch.no_grad():
        routers = pair.ref(ids, output_router_logits=True).router_logits
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert len(routers) == len(moe_layers)
    for layer, logits in zip(moe_layers, routers, strict=True):
        chosen = logits.float().softmax(-1).topk(cfg.num_experts_per_tok, dim=-1).indices
        expected = torch.bincount(chosen.flatten(), minlength=cfg.num_experts)
        assert torch.equal(counts[layer], expected)
    for layer in range(cfg.num_layers):
        if layer not in moe_layers:
            assert counts[layer].sum().item() == 0
    # Untracked forwards add nothing.
    pair.ours(ids)
    assert torch.equal(pair.ours.expert_token_counts() - before, counts)


@pytest.mark.parametrize("compute", [None, torch.bfloat16], ids=["auto-compute", "bf16-compute"])
def test_bf16_matches_transformers_bf16(pair: Pair, compute: torch.dtype | None) -> None:
    """bf16 weights run on CPU, with widened (auto on CPUs without native bf16) or native bf16
    activations, and stay close to transformers in bf16 (rounding differs slightly)."""
    ours = load_model(pair.path, dtype="bf16", compute_dtype=compute)
    assert ours.dtype == torch.bfloat16
    if compute is not None:
        assert ours.compute_dtype == compute
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        pair.path, attn_implementation="eager", dtype=torch.bfloat16
    ).eval()
    ids = random_ids(pair, 1, 12, seed=4)
    got = ours(ids, block_size=4)
    expected = ref_logits(ref, ids, 4)
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 0.05 * scale
    assert got.dtype == torch.float32


def test_compute_dtype_widens_half_precision_only_on_cpus_without_support(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    assert default_compute_dtype(torch.bfloat16, cpu) == torch.float32
    assert default_compute_dtype(torch.float16, cpu) == torch.float32
    assert default_compute_dtype(torch.float32, cpu) == torch.float32
    assert default_compute_dtype(torch.bfloat16, gpu) == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert default_compute_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert default_compute_dtype(torch.float16, cpu) == torch.float32


def test_narrow_weights_keep_a_narrow_cache_and_fp32_logits(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint, dtype="bf16", compute_dtype=torch.float32)
    cache = KVCache(model.config, num_slots=1, max_seq_len=8, dtype=model.dtype)
    ids = torch.arange(8).view(1, 8)
    full = model(ids, block_size=4)
    model(
        ids[:, :4],
        block_size=4,
        cache=cache,
        slots=torch.tensor([0]),
        cache_lens=torch.tensor([0]),
        write_cache=True,
    )
    assert cache.keys[0].dtype == torch.bfloat16
    assert cache.keys[0][0, :, :4].abs().sum() > 0
    last = model(
        ids[:, 4:],
        torch.arange(4, 8).view(1, 4),
        block_size=4,
        cache=cache,
        slots=torch.tensor([0]),
        cache_lens=torch.tensor([4]),
    )
    assert full.dtype == last.dtype == torch.float32
    # The cache rounds keys/values to bf16, so allow bf16-sized differences only.
    assert (last - full[:, 4:]).abs().max().item() <= 0.02 * full.abs().max().item()


def test_bad_cache_arguments_are_explained(tiny_checkpoint: Path) -> None:
    model = load_model(tiny_checkpoint)
    cache = KVCache(model.config, num_slots=2, max_seq_len=8)
    ids = torch.zeros(1, 4, dtype=torch.long)
    one, zero = torch.tensor([1]), torch.tensor([0])
    with pytest.raises(ValueError, match="slots and cache_lens of shape"):
        model(ids, cache=cache, slots=one)
    with pytest.raises(ValueError, match=r"slots must be in \[0, 2\)"):
        model(ids, cache=cache, slots=torch.tensor([2]), cache_lens=zero)
    with pytest.raises(ValueError, match="reach 10 but the cache holds 8"):
        model(
            ids,
            torch.arange(6, 10).view(1, 4),
            cache=cache,
            slots=one,
            cache_lens=zero,
            write_cache=True,
        )
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        model(ids, block_size=0, cache=cache, slots=one, cache_lens=zero)
    with pytest.raises(ValueError, match="write_cache=True needs a cache"):
        model(ids, write_cache=True)


def test_widened_lm_head_in_slices_equals_one_matmul() -> None:
    """A bf16 head widened slice by slice (here 3 slices) gives the one-shot fp32 result."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(70000, 32, generator=gen).to(torch.bfloat16)
    x = torch.randn(5, 32, generator=gen)
    sliced = vocab_logits(x, weight)
    assert torch.allclose(sliced, x @ weight.float().T, atol=1e-5)


def test_prefill_asking_for_no_logits_still_fills_the_cache(pair: Pair) -> None:
    """A chunked prefill wants no logits at all: (0, vocab) back, cache written all the same."""
    ids = random_ids(pair, 1, 8, seed=13)
    cache = KVCache(pair.ours.config, num_slots=1, max_seq_len=12)
    out = pair.ours(
        ids,
        cache=cache,
        slots=torch.tensor([0]),
        cache_lens=torch.tensor([0]),
        write_cache=True,
        logits_rows=torch.tensor([], dtype=torch.long),
    )
    assert out.shape == (0, pair.ours.config.vocab_size)
    nxt = random_ids(pair, 1, 4, seed=14)
    last = pair.ours(
        nxt,
        torch.arange(8, 12).view(1, 4),
        cache=cache,
        slots=torch.tensor([0]),
        cache_lens=torch.tensor([8]),
    )
    full = pair.ours(torch.cat((ids, nxt), dim=1))
    assert (last - full[:, 8:]).abs().max().item() <= TOL
