"""DiffusionGemma through the shared engine core: continuous batching, the family's rules, and
the same tokens as the batch-1 yardstick (`generate`, itself held to transformers' generate())."""

from __future__ import annotations

import pytest
import torch

from engine.core import EngineCore
from engine.errors import InvalidParams
from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo
from engine.families.diffusion_gemma.generate import generate
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.loader import load_model, load_tokenizer
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.engine.decoding_fixtures import one_thread, run_core

# Tiny matmuls on one thread: on a loaded 2-core machine two threads made this file 15x slower.
pytestmark = pytest.mark.usefixtures(one_thread.__name__)

# How much of each residual branch is kept (see `parts`).
BRANCH_SCALE = 0.2


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[DiffusionGemmaModel, Tokenizer]:
    directory = create_diffusion_gemma_demo(tmp_path_factory.mktemp("dg") / "demo")
    model = load_model(directory, dtype=torch.float32)
    assert isinstance(model, DiffusionGemmaModel)
    # A random model is chaotic in its canvas: near-equal entropies everywhere, so float noise
    # of a batched matmul reorders acceptance. With its residual branches scaled down the
    # decoder mostly echoes its canvas, entropies spread and canvases settle after 2-4 steps
    # (as in reference_generation.py): rows of one batch then sit at different steps, and
    # token equality tests the engine, not rounding.
    with torch.no_grad():
        for layer in model.layers:
            layer.post_attn_norm.mul_(BRANCH_SCALE)
            layer.post_ffn_norm.mul_(BRANCH_SCALE)
        model.self_cond.down.weight.mul_(BRANCH_SCALE)
    return model, load_tokenizer(directory)


def core_of(parts: tuple[DiffusionGemmaModel, Tokenizer], batch: int = 4) -> EngineCore:
    model, tokenizer = parts
    return EngineCore(model, tokenizer, max_batch_size=batch, max_seq_len=256)


PROMPTS = {
    "a": [2, 5, 9, 11, 40, 41, 42],
    "b": [2, 100, 101],
    "c": [2, *range(60, 100)],  # longer than the demo's sliding window (32)
    "d": [2, 7],
}


def yardstick(
    parts: tuple[DiffusionGemmaModel, Tokenizer], prompt: list[int], max_tokens: int, seed: int
) -> list[int]:
    """The batch-1 generation's tokens, without the EOS the engine leaves out of its output."""
    model, _ = parts
    result = generate(
        model,
        prompt,
        model.config.decoding,
        max_new_tokens=max_tokens,
        seed=seed,
        vocab_size=model.config.vocab_size,
    )
    tokens = result.token_ids
    if result.finish_reason == "stop":
        tokens = tokens[:-1]
    return tokens


def test_a_seeded_request_alone_makes_the_batch_1_generation(
    parts: tuple[DiffusionGemmaModel, Tokenizer],
) -> None:
    params = SamplingParams(max_tokens=40, seed=7)
    out = run_core(core_of(parts, batch=1), {"a": (PROMPTS["a"], params)})["a"]
    assert out.token_ids == yardstick(parts, PROMPTS["a"], 40, 7)
    assert out.stats is not None
    # Canvases stop early (stable and confident), within the checkpoint's cap of 8 steps.
    assert out.stats.steps_per_block and all(2 <= s < 8 for s in out.stats.steps_per_block)


def test_batching_changes_no_requests_tokens(
    parts: tuple[DiffusionGemmaModel, Tokenizer],
) -> None:
    requests = {
        rid: (prompt, SamplingParams(max_tokens=24 + 8 * i, seed=i))
        for i, (rid, prompt) in enumerate(PROMPTS.items())
    }
    together = run_core(core_of(parts, batch=4), requests)
    for i, (rid, (prompt, params)) in enumerate(requests.items()):
        assert together[rid].token_ids == yardstick(parts, prompt, params.max_tokens, i)


def test_more_requests_than_slots_wait_and_still_match(
    parts: tuple[DiffusionGemmaModel, Tokenizer],
) -> None:
    requests = {
        f"{rid}{n}": (prompt, SamplingParams(max_tokens=20, seed=n))
        for n in range(2)
        for rid, prompt in PROMPTS.items()
    }
    out = run_core(core_of(parts, batch=3), requests)
    for rid, (prompt, _) in requests.items():
        assert out[rid].token_ids == yardstick(parts, prompt, 20, int(rid[-1]))


def test_streamed_canvases_add_up_to_the_output(
    parts: tuple[DiffusionGemmaModel, Tokenizer],
) -> None:
    params = SamplingParams(max_tokens=48, seed=3, ignore_eos=True)
    out = run_core(core_of(parts, batch=1), {"a": (PROMPTS["a"], params)})["a"]
    assert len(out.token_ids) == 48 and out.finish_reason == "length"
    assert out.updates == 3  # one per committed canvas of 16


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"threshold": 0.5}, "threshold"),
        ({"steps": 4}, "steps"),
        ({"top_k": 5}, "top_k"),
        ({"top_p": 0.5}, "top_p"),
        ({"block_size": 8}, "block_size"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_masked_diffusion_settings_are_refused_by_name(
    parts: tuple[DiffusionGemmaModel, Tokenizer], change: dict[str, object], field: str
) -> None:
    core = core_of(parts)
    with pytest.raises(InvalidParams) as info:
        core.add_request("r", PROMPTS["b"], SamplingParams(max_tokens=8, **change))  # type: ignore[arg-type]
    assert info.value.field == field and field in str(info.value)
    assert not core.has_unfinished()


def test_max_steps_caps_every_canvas(parts: tuple[DiffusionGemmaModel, Tokenizer]) -> None:
    params = SamplingParams(max_tokens=32, seed=1, max_steps=2, ignore_eos=True)
    out = run_core(core_of(parts, batch=1), {"a": (PROMPTS["a"], params)})["a"]
    assert out.stats is not None and out.stats.steps_per_block == [2, 2]
