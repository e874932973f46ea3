"""Shared pieces of the decoding tests: a peaked tiny model and a plain reference decoder.

The random tiny checkpoint's logits are nearly flat (confidences ~1/vocab), which would make
every greedy choice a near-tie. Scaling its LM head by LM_HEAD_SCALE spreads them so that
confidences straddle a 0.9 threshold and top-2 margins are mostly far above float noise.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine.core import EngineCore, RequestStats
from engine.loader import load_sdar_model, load_tokenizer
from engine.model import Model
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.engine.conftest import MASK_ID, TOKENIZER_VOCAB

LM_HEAD_SCALE = 100.0


@dataclass
class Parts:
    """A loaded model and tokenizer, shared read-only by the tests of a session."""

    model: Model
    tokenizer: Tokenizer

    def core(self, *, max_batch_size: int = 8, max_seq_len: int = 256) -> EngineCore:
        """A fresh EngineCore (own KV cache) over the shared model."""
        return EngineCore(
            self.model, self.tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len
        )


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a test on one intra-op thread, then restore the setting.

    The tiny model's matmuls are microseconds; splitting them over threads only adds
    synchronisation, which on a loaded 2-core CI machine made these tests 20x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def peaked(tiny_checkpoint: Path) -> Parts:
    """The tiny checkpoint with its LM head scaled (see the module docstring)."""
    model = load_sdar_model(tiny_checkpoint)
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
    return Parts(model, load_tokenizer(tiny_checkpoint))


@dataclass
class Result:
    """What the engine produced for one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stats: RequestStats | None = None
    updates: int = 0


def run_core(
    core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, Result]:
    """Submit the requests, step until nothing is left, and collect every request's output
    (also of requests added to `core` before the call)."""
    results = {rid: Result() for rid in requests}
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    while core.has_unfinished():
        for update in core.step():
            res = results.setdefault(update.request_id, Result())
            res.token_ids += update.new_token_ids
            res.text += update.text_delta
            res.updates += 1
            if update.finished:
                res.finish_reason, res.stats = update.finish_reason, update.stats
    return results


@dataclass
class Reference:
    """The reference decoder's output, with how fragile each of its decisions was."""

    tokens: list[int]
    finalized_at_step: list[int]  # generated index -> global step that fixed it
    step_margins: list[float]  # per global step: smallest decision margin


def reference_decode(
    model: Model, prompt: list[int], params: SamplingParams, *, block_size: int, eos: set[int]
) -> Reference:
    """Greedy block-diffusion decoding written plainly: full recompute, no cache, one request.

    Follows the issue's rules literally; every step reruns the whole sequence with the
    block-causal mask and reads the logits of the current block.
    """
    width, plen = block_size, len(prompt)
    seq = list(prompt)
    finalized: dict[int, int] = {}
    margins: list[float] = []
    block_start = plen // width * width
    while True:
        block = seq[block_start:] + [MASK_ID] * (block_start + width - len(seq))
        masked = [block_start + i >= plen for i in range(width)]
        at_start, k = sum(masked), 0
        while any(masked):
            ids = torch.tensor([seq[:block_start] + block])
            with torch.no_grad():
                logits = model(ids, block_size=width)[0, block_start:].double()
            logits[:, MASK_ID] = -math.inf
            logits[:, TOKENIZER_VOCAB:] = -math.inf
            probs = torch.softmax(logits, dim=-1)
            top2 = probs.topk(2, dim=-1)
            conf = top2.values[:, 0].tolist()
            choice = top2.indices[:, 0].tolist()
            candidates = [i for i in range(width) if masked[i]]
            margin = min(float(top2.values[i, 0] - top2.values[i, 1]) for i in candidates)
            left = len(candidates)
            if params.max_steps is not None and k + 1 >= params.max_steps:
                count = left
            elif params.steps is not None:
                count = at_start // params.steps + (1 if k < at_start % params.steps else 0)
            else:
                count = max(1, sum(conf[i] >= params.threshold for i in candidates))
                margin = min([margin] + [abs(conf[i] - params.threshold) for i in candidates])
                if k < params.min_steps:
                    count = min(count, math.ceil(left / (params.min_steps - k)))
            ranked = sorted(candidates, key=lambda i: (-conf[i], i))
            if count < left:
                margin = min(margin, conf[ranked[count - 1]] - conf[ranked[count]])
            for i in ranked[:count]:
                block[i], masked[i] = choice[i], False
                finalized[block_start + i - plen] = len(margins)
            margins.append(margin)
            k += 1
        seq = seq[:block_start] + block
        generated = seq[plen:]
        hit = next((i for i, t in enumerate(generated[: params.max_tokens]) if t in eos), None)
        if hit is not None or len(generated) >= params.max_tokens:
            end = params.max_tokens if hit is None else hit
            order = [finalized[i] for i in range(min(end + 1, len(generated)))]
            return Reference(generated[:end], order, margins)
        block_start += width


def assert_matches_reference(got: list[int], ref: Reference, label: str) -> None:
    """Tokens must be equal, unless the reference's decision was within 1e-4 of flipping."""
    if got == ref.tokens:
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b),
        min(len(got), len(ref.tokens)),
    )
    last_step = ref.finalized_at_step[min(first, len(ref.finalized_at_step) - 1)]
    fragile = min(ref.step_margins[: last_step + 1])
    assert fragile < 1e-4, (
        f"{label}: engine {got} != reference {ref.tokens} (first difference at {first}; "
        f"smallest reference margin up to there {fragile:.3g})"
    )
