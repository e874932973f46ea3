"""The shipped demo model: trained, it loads like any checkpoint and says words.

These figures are what the README quotes; the test recomputes them from the packaged files.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import engine
from engine.llm import LLM
from engine.loader import load_model, load_tokenizer
from engine.model import Model
from engine.params import SamplingParams
from engine.training.objective import corrupt, masked_logits
from engine.training.train import initialise

DEMO = Path(engine.__file__).parent / "demo_model"
WINDOW = 128


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(DEMO, dtype="float32", max_batch_size=24, max_seq_len=512)


def prompts() -> list[str]:
    lines = (DEMO / "prompts.txt").read_text(encoding="utf-8").splitlines()
    return [line for line in lines if line.strip()]


def held_out_loss(model: Model, ids: torch.Tensor, mask_id: int) -> float:
    gen = torch.Generator().manual_seed(0)
    noisy, masked = corrupt(ids, 16, mask_id, gen)
    with torch.no_grad():
        logits = masked_logits(model, ids, noisy, masked, 16)
    return float(torch.nn.functional.cross_entropy(logits, ids[masked]))


def test_held_out_masked_token_loss_is_far_below_a_random_models(llm: LLM) -> None:
    tokenizer = load_tokenizer(DEMO)
    text = (DEMO / "heldout.txt").read_text(encoding="utf-8")
    stream = tokenizer.encode(text)
    rows = len(stream) // WINDOW
    ids = torch.tensor(stream[: rows * WINDOW]).view(rows, WINDOW)[::8][:16]
    # The training objective's differentiable form needs the plain (unpacked) expert weights.
    trained = held_out_loss(load_model(DEMO, dtype="float32"), ids, llm.config.mask_token_id)

    untrained = Model(llm.config, dtype=torch.float32)
    initialise(untrained, torch.Generator().manual_seed(0))
    random_loss = held_out_loss(untrained, ids, llm.config.mask_token_id)
    print(f"held-out masked-token loss: trained {trained:.3f}, random {random_loss:.3f}")
    assert random_loss > 0.9 * math.log(llm.config.vocab_size)
    assert trained < random_loss - 2.0  # e^2: over seven times more likely per masked token


def test_threshold_decoding_answers_in_words(llm: LLM) -> None:
    params = SamplingParams(max_tokens=64, threshold=0.9, block_size=16, thinking=False)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts()], params)
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(sum(o.stats.steps_per_block) for o in outputs if o.stats)
    print(f"threshold 0.9, block 16: {tokens / steps:.2f} tokens per denoising forward")
    # Parallel unmasking pays: the model is sure of more than the one position it must take.
    assert tokens / steps >= 1.2

    dictionary = set((DEMO / "words.txt").read_text(encoding="utf-8").split())
    words: list[str] = []
    for out in outputs:
        assert "\ufffd" not in out.text  # whole UTF-8 characters only
        out.text.encode("utf-8")
        words += [w.lower() for w in re.findall(r"[A-Za-z]+", out.text)]
    known = sum(w in dictionary for w in words)
    print(f"{len(words)} words, {known / len(words):.1%} in the corpus's word list")
    assert len(words) >= 8 * len(outputs)
    assert known / len(words) >= 0.9
    # Words, not fragments: the average length of English prose, not of stray subwords.
    assert sum(map(len, words)) / len(words) >= 3.0


def test_dctl_tune_draws_a_curve_and_recommends_more_than_a_token_a_step(
    tmp_path: Path,
) -> None:
    from tests.tune.conftest import dctl

    out = tmp_path / "tune"
    # A third of the prompts and one thread: the sweep shares the CPU with the rest of the suite.
    chosen = tmp_path / "prompts.txt"
    chosen.write_text("\n".join(prompts()[:8]) + "\n", encoding="utf-8")
    thresholds = ["0.5", "0.7", "0.8", "0.9", "0.95"]
    result = dctl(
        "tune", str(DEMO), "--prompts", str(chosen), "--block-sizes", "16",
        "--thresholds", ",".join(thresholds), "--max-tokens", "32", "--heldout-passages", "1",
        "--threads", "1", "--no-plot", "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    data = json.loads((out / "results.json").read_text())
    per_forward = {
        s["label"]: s["tokens_per_forward"] for s in data["settings"] if not s["reference"]
    }
    print(per_forward, data["recommendation"]["label"])
    # Not flat: the threshold moves how many positions a step accepts.
    assert len({round(v, 2) for v in per_forward.values()}) >= 3
    assert per_forward["B16 t=0.5"] > per_forward["B16 t=0.95"]
    # The recommendation (agreement >= 0.9 with one token a step) takes more than one a step.
    assert per_forward[data["recommendation"]["label"]] > 1.0


def test_it_loads_like_any_checkpoint_and_matches_transformers() -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = load_model(DEMO, dtype="fp32")
    tokenizer = load_tokenizer(DEMO)
    fields = json.loads((DEMO / "config.json").read_text())
    for key in ("model_type", "architectures", "mask_token_id", "block_size"):
        fields.pop(key)
    reference = Qwen3MoeForCausalLM.from_pretrained(
        DEMO, config=Qwen3MoeConfig(**fields), torch_dtype=torch.float32
    ).eval()
    ids = torch.tensor([tokenizer.encode("And God said unto Moses, I AM THAT I AM.")])
    with torch.no_grad():
        ours = model(ids, block_size=1)
        theirs = reference(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4)
