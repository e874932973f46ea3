"""Prepacked CPU weights (engine.packing): when the engine packs, and that a packed model
computes what the plain one does, in the same memory."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import packing
from engine.config import ModelConfig
from engine.demo_checkpoint import create_demo_checkpoint
from engine.kv_cache import KVCache
from engine.llm import LLM
from engine.loader import load_model
from engine.model import DenseMLP, Model, MoE
from engine.params import SamplingParams

CPU = torch.device("cpu")
# The dtypes this machine's oneDNN packs: fp32 everywhere, bf16/fp16 where the CPU has them.
PACKABLE = [d for d in (torch.float32, torch.bfloat16) if packing.supported(CPU, d)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The tiny demo model: MoE layers, an untied LM head.
    return create_demo_checkpoint(tmp_path_factory.mktemp("packed") / "tiny", seed=3, size="tiny")


def test_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert packing.scope("off", CPU, bf16, bf16) == "none"
    # Weights widened per matmul: a packed copy would be in the wrong dtype.
    assert packing.scope("on", CPU, bf16, fp32) == "none"
    # This CPU build of torch has oneDNN: fp32 packing is always there.
    assert packing.supported(CPU, fp32)
    # On an Intel CPU auto leaves fp32's few-row MoE products to MKL; "on" packs them too.
    monkeypatch.setattr(packing, "sgemm_leads_few_rows", lambda: True)
    assert packing.scope("auto", CPU, fp32, fp32) == "dense"
    assert packing.scope("on", CPU, fp32, fp32) == "all"
    # Elsewhere MKL's sgemm is the slower one: auto packs the experts too.
    monkeypatch.setattr(packing, "sgemm_leads_few_rows", lambda: False)
    assert packing.scope("auto", CPU, fp32, fp32) == "all"
    assert packing.scope("auto", CPU, bf16, fp32) == "none"
    half = "all" if packing.supported(CPU, bf16) else "none"
    assert packing.scope("auto", CPU, bf16, bf16) == half
    assert packing.scope("on", torch.device("cuda"), bf16, bf16) == "none"


@pytest.mark.parametrize("dtype", PACKABLE, ids=str)
def test_few_row_products_are_those_of_f_linear(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64).to(dtype)
    bias = torch.randn(96).to(dtype)
    packed = packing.pack(weight)
    assert packing.is_packed(packed) and not packing.is_packed(weight)
    for shape in [(1, 64), (5, 64), (2, 16, 64)]:
        x = torch.randn(*shape).to(dtype)
        got, want = packing.linear(x, packed, bias), F.linear(x, weight, bias)
        assert got.shape == want.shape and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the same oneDNN kernel, without the per-call reorder
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", PACKABLE, ids=str)
def test_a_packed_model_computes_what_the_plain_one_does(
    checkpoint: Path, dtype: torch.dtype
) -> None:
    plain = load_model(checkpoint, dtype=dtype, compute_dtype=dtype)
    packed = load_model(checkpoint, dtype=dtype, compute_dtype=dtype, packed_weights="on")
    assert packed.packed and not plain.packed
    # Packing replaces the weights (no second copy): the same bytes, now in the packed layout.
    assert packed.weight_bytes() == plain.weight_bytes()
    assert packed.layers[0].mlp.w_gate_up.numel() == 0  # type: ignore[union-attr]
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.05, "atol": 0.05}
    gen = torch.Generator().manual_seed(1)
    vocab = plain.config.vocab_size
    ids = torch.randint(0, vocab, (2, 24), generator=gen)
    # The parity form (no cache) ...
    torch.testing.assert_close(packed(ids, block_size=4), plain(ids, block_size=4), **tol)
    # ... and a prefill then a denoising step against the cache, logits of some rows only.
    outs = []
    for model in (plain, packed):
        cache = KVCache(model.config, 2, 40, dtype=dtype)
        slots, zero, lens = torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([24, 24])
        model(ids, cache=cache, slots=slots, cache_lens=zero, write_cache=True)
        block = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(2))
        positions = torch.arange(24, 32).expand(2, 8)
        rows = torch.tensor([3, 5, 6, 7, 12, 15])
        outs.append(
            model(block, positions, block_size=8, cache=cache, slots=slots, cache_lens=lens,
                  logits_rows=rows)
        )  # fmt: skip
    torch.testing.assert_close(outs[1], outs[0], **tol)


def test_dense_layers_and_attention_biases_are_packed_too() -> None:
    config = ModelConfig.from_hf(
        {
            "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0],
            "attention_bias": True,
        },
        None,
        tokenizer_mask_token_id=63,
        source="test",
    )  # fmt: skip
    torch.manual_seed(0)
    plain = Model(config)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    packed = copy.deepcopy(plain)
    assert packed.pack_weights() == 0
    assert isinstance(packed.layers[0].mlp, DenseMLP)
    assert packing.is_packed(packed.layers[0].mlp.w_down.weight)
    assert packing.is_packed(packed.layers[1].attn.wqkv.weight)
    ids = torch.randint(0, 64, (1, 12))
    torch.testing.assert_close(packed(ids, block_size=4), plain(ids, block_size=4))


@pytest.mark.parametrize(
    ("text", "vendor"),
    [
        ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t: avx2\n", "GenuineIntel"),
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\n", "AuthenticAMD"),
        ("processor\t: 0\nCPU implementer\t: 0x41\n", None),  # ARM names no vendor
    ],
)
def test_the_cpu_vendor_is_read_from_cpuinfo(tmp_path: Path, text: str, vendor: str | None) -> None:
    (tmp_path / "cpuinfo").write_text(text)
    assert packing.cpu_vendor(tmp_path / "cpuinfo") == vendor
    assert packing.cpu_vendor(tmp_path / "missing") is None


def test_auto_packs_fp32_experts_where_mkl_is_the_slower(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packing, "sgemm_leads_few_rows", lambda: False)
    plain = load_model(checkpoint, dtype="fp32")
    auto = load_model(checkpoint, dtype="fp32", packed_weights="auto")
    assert auto.weights_layout == "packed"
    moe = auto.layers[0].mlp
    assert isinstance(moe, MoE) and moe.packed_experts is not None
    assert packing.is_packed(moe.router) and moe.w_gate_up.numel() == 0
    ids = torch.randint(0, plain.config.vocab_size, (1, 16))
    torch.testing.assert_close(auto(ids, block_size=4), plain(ids, block_size=4))


def test_the_dense_scope_leaves_the_moe_to_mkl(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(packing, "sgemm_leads_few_rows", lambda: True)  # an Intel CPU
    plain = load_model(checkpoint, dtype="fp32")
    dense = load_model(checkpoint, dtype="fp32", packed_weights="auto")
    assert (plain.weights_layout, dense.weights_layout) == ("plain", "packed_except_experts")
    moe = dense.layers[0].mlp
    assert isinstance(moe, MoE) and moe.packed_experts is None
    assert not packing.is_packed(moe.router) and moe.w_gate_up.numel() > 0
    assert packing.is_packed(dense.layers[0].attn.wqkv.weight)
    assert packing.is_packed(dense.lm_head.weight)
    ids = torch.randint(0, plain.config.vocab_size, (1, 16))
    torch.testing.assert_close(dense(ids, block_size=4), plain(ids, block_size=4))


def test_packing_a_tied_head_reports_its_extra_copy(tmp_path: Path) -> None:
    tied = create_demo_checkpoint(tmp_path / "tied", seed=0, size="tiny")
    config = (
        (tied / "config.json")
        .read_text()
        .replace('"tie_word_embeddings": false', '"tie_word_embeddings": true')
    )
    (tied / "config.json").write_text(config)
    model = load_model(tied, dtype="fp32")
    assert model.lm_head.weight is model.embed.weight
    embed = model.embed.weight
    assert model.pack_weights() == embed.numel() * embed.element_size()
    assert not packing.is_packed(model.embed.weight)  # the lookup keeps the plain matrix
    assert model.pack_weights() == 0  # packing twice is a no-op


def test_llm_greedy_output_is_the_same_packed(checkpoint: Path) -> None:
    params = SamplingParams(max_tokens=12, block_size=4, steps=2, temperature=0.0)
    prompts = ["The river", "One two three"]
    plain = LLM(checkpoint, dtype="fp32", max_batch_size=2, max_seq_len=128, packed_weights="off")
    packed = LLM(checkpoint, dtype="fp32", max_batch_size=2, max_seq_len=128, packed_weights="on")
    assert packed.model.packed and not plain.model.packed
    got = [o.token_ids for o in packed.generate(prompts, params)]
    assert got == [o.token_ids for o in plain.generate(prompts, params)]
    assert all(len(ids) == 12 for ids in got)
