"""Measuring settings in-process: the checkpoint built by `engine.factory` (as `LLM` and the
server build theirs), requests fed to its core.

Latency is per request: at most `concurrency` requests are in the engine at once, and the next
prompt enters only when one finishes, so a request's end-to-end time never includes waiting
behind prompts that were queued only because the sweep knows them all in advance.
"""

from __future__ import annotations

import itertools
import platform
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from engine.core import RequestStats
from engine.errors import CheckpointError, EngineError
from engine.factory import BuiltEngine, EngineOptions, build_engine
from engine.loader import load_tokenizer
from engine.params import SamplingParams, padded_length
from engine.tokenizer import Tokenizer
from engine.tuning.grid import DecodeSetting
from engine.tuning.scoring import Batch, RequestSample
from engine.tuning.workload import HELDOUT_PROMPT_TOKENS, HeldoutPassage, heldout_passages


def encode_prompts(tokenizer: Tokenizer, messages: Sequence[str]) -> tuple[list[list[int]], str]:
    """Token ids of each user message and how they were rendered.

    With a chat template: one user turn, thinking off (a thinking preamble would dominate a short
    answer and make every setting look alike). Without one: the message as plain text.
    """
    if tokenizer.has_chat_template:
        ids = [
            tokenizer.encode_chat([{"role": "user", "content": m}], enable_thinking=False)
            for m in messages
        ]
        return ids, "chat template, thinking off"
    plain = "plain text (the checkpoint has no chat template)"
    return [tokenizer.encode(m) for m in messages], plain


@dataclass
class InProcessRunner:
    """Runs settings on a checkpoint loaded in this process (greedy, temperature 0)."""

    engine: BuiltEngine
    prompts: list[list[int]]
    passages: list[HeldoutPassage]
    rendering: str
    notes: list[str] = field(default_factory=list)
    _ids: Any = field(default_factory=itertools.count)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        messages: Sequence[str],
        *,
        block_sizes: Sequence[int],
        max_tokens: int,
        concurrency: int,
        heldout: Sequence[str] | None,
        heldout_count: int,
        dtype: str,
        device: str,
        threads: int | None = None,
    ) -> InProcessRunner:
        """Load the checkpoint sized for this sweep; HELDOUT holds paragraphs (None: no file).

        THREADS sets torch's CPU threads as `resources.threads` does for a server, so the
        latencies are those of the configuration that will serve (None: torch's default).
        """
        _require_masked_family(model_dir)
        tokenizer = load_tokenizer(model_dir)
        prompts, rendering = encode_prompts(tokenizer, messages)
        notes = []
        passages: list[HeldoutPassage] = []
        if heldout is not None and heldout_count > 0:
            passages = heldout_passages(
                heldout, tokenizer.encode, count=heldout_count, continuation=max(block_sizes)
            )
            if len(passages) < heldout_count:
                notes.append(
                    f"held-out accuracy uses {len(passages)} passages (asked {heldout_count}): "
                    f"only these have {HELDOUT_PROMPT_TOKENS} + {max(block_sizes)} tokens"
                )
        # The cache is sized for the longest request of the sweep, not the model's whole context.
        lengths = [padded_length(len(p), max_tokens, b) for p in prompts for b in block_sizes] + [
            padded_length(HELDOUT_PROMPT_TOKENS, b, b) for b in block_sizes if passages
        ]
        options = EngineOptions(
            dtype=dtype,
            device=device,
            max_batch_size=max(concurrency, len(passages), 1),
            max_seq_len=max(lengths),
            threads=threads,
        )
        return cls(build_engine(model_dir, options), prompts, passages, rendering, notes)

    def describe(self) -> dict[str, Any]:
        """The model and machine the numbers belong to."""
        config, model = self.engine.config, self.engine.model
        return {
            "model_type": config.model_type,
            "checkpoint_block_size": config.block_size,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": str(model.device),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "prompt_rendering": self.rendering,
            "heldout_passages": len(self.passages),
        }

    def warm_up(self, setting: DecodeSetting) -> None:
        """One short request, so that one-time start-up costs land in no setting's latency."""
        params = _params(setting, max_tokens=setting.block_size)
        self._decode([self.prompts[0]], params, concurrency=1)

    def run(self, setting: DecodeSetting, *, max_tokens: int, concurrency: int) -> Batch:
        """Every prompt under SETTING, `concurrency` at a time."""
        params = _params(setting, max_tokens=max_tokens)
        start = perf_counter()
        finished = self._decode(self.prompts, params, concurrency=concurrency)
        wall = perf_counter() - start
        samples = [
            RequestSample(
                e2e_s=stats.e2e_s,
                completion_tokens=stats.completion_tokens,
                units=tokens,
                denoise_steps=sum(stats.steps_per_block),
                engine_tokens_per_forward=stats.tokens_per_forward,
            )
            for tokens, stats in finished
        ]
        return Batch(samples, wall)

    def heldout_accuracy(self, setting: DecodeSetting) -> float | None:
        """Fraction of the true next block_size tokens the setting reproduces (None: no file).

        All passages decode together (accuracy is not a latency figure). An early stop (EOS)
        leaves positions unfilled; they count as wrong.
        """
        if not self.passages:
            return None
        block = setting.block_size
        params = _params(setting, max_tokens=block)
        finished = self._decode(
            [p.prompt for p in self.passages], params, concurrency=len(self.passages)
        )
        right = sum(
            sum(a == b for a, b in zip(tokens, passage.continuation[:block], strict=False))
            for (tokens, _), passage in zip(finished, self.passages, strict=True)
        )
        return right / (block * len(self.passages))

    def _decode(
        self, prompts: Sequence[list[int]], params: SamplingParams, *, concurrency: int
    ) -> list[tuple[list[int], RequestStats]]:
        """Decode PROMPTS keeping at most CONCURRENCY in the engine; results in prompt order."""
        core = self.engine.core
        waiting = deque(enumerate(prompts))
        active: dict[str, int] = {}
        tokens: list[list[int]] = [[] for _ in prompts]
        stats: list[RequestStats | None] = [None] * len(prompts)
        try:
            while waiting or core.has_unfinished():
                while waiting and len(active) < concurrency:
                    index, ids = waiting.popleft()
                    request_id = f"tune-{next(self._ids)}"
                    core.add_request(request_id, ids, params)
                    active[request_id] = index
                for update in core.step():
                    index = active[update.request_id]
                    tokens[index].extend(update.new_token_ids)
                    if update.finished:
                        stats[index] = update.stats
                        del active[update.request_id]
        except BaseException:
            for request_id in active:
                core.abort_request(request_id)
            while core.has_unfinished():
                core.step()
            raise
        done = [(t, s) for t, s in zip(tokens, stats, strict=True) if s is not None]
        if len(done) != len(prompts):
            raise EngineError(f"{len(prompts) - len(done)} requests ended without their stats")
        return done


def _params(setting: DecodeSetting, *, max_tokens: int) -> SamplingParams:
    # Greedy: the sweep compares schedules, so sampling noise must not enter the comparison.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **setting.request_fields())


def _require_masked_family(model_dir: Path) -> None:
    """Refuse, before loading anything, a checkpoint whose family has no masked-decoding knobs:
    a sweep of thresholds, steps and block sizes means nothing for it."""
    from engine.config import read_checkpoint_json
    from engine.families.registry import family_of

    source = model_dir / "config.json"
    if not source.is_file():
        return  # the loader says what is missing
    family = family_of(read_checkpoint_json(source), source=str(source))
    if family != "sdar":
        raise CheckpointError(
            f"{source}: dctl tune sweeps masked-diffusion settings (threshold, steps, block "
            f"size); the {family} family decodes a uniform-noise canvas and has none of them"
        )
