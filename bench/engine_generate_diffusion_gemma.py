"""DiffusionGemma generation speed: our engine vs transformers' `generate()`, same weights, same
run (CPU, fp32). Run as `bench/engine_generate.py --family diffusion-gemma` (or this script).

Checkpoint: by default a random one written by `engine.families.diffusion_gemma.demo` at the
benchmark shape below (`--checkpoint DIR` takes any DiffusionGemma checkpoint instead), large
enough that matmuls, not Python, take most of a step. Both sides load it in fp32 and decode with
its generation_config.json settings, passed explicitly to transformers; no EOS on either side
(ours `ignore_eos`, theirs `eos_token_id=None`), so every request makes exactly `--new` tokens.
With a random model no canvas gets confident, so every canvas runs to the step limit on both
sides (steps per canvas are printed for both).

- batch 1: the first `--singles` prompts one at a time, alternately ours (`engine.LLM`, its own
  seed per request) and transformers (`torch.manual_seed(seed)` then `generate`): the median
  tokens/s of each. Same seed, same weights: the tokens should be equal (the count is printed;
  a random model is chaotic, so rounding differences can still change a draw).
- batch 16 aggregate: ours takes all 16 prompts at once (continuous batching); transformers,
  which has no continuous batching, runs them one by one: its aggregate is its batch-1 rate
  (the median above; every request does the same work), the issue's yardstick. Its `generate`
  also takes a batch of equal-length prompts (rows run until the slowest canvas stops); that
  form is timed too and printed beside it. Ours and its batched form alternate, `--repeats`
  times; medians.
Goals (issue 28): ours >= 2x transformers at batch 1, >= 5x in aggregate at batch 16.
Tokens/s is wall clock; on a shared machine it depends on the neighbours, so the ratios are
also given by CPU time of this process (`time.process_time`), which they barely move.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.families.diffusion_gemma.demo import TINY, DemoShape, create_diffusion_gemma_demo

# Random weights, sized so a step's matmuls outweigh its Python on 2 cores (see the docstring).
BENCH_SHAPE = DemoShape(
    vocab_size=4096,
    hidden=384,
    intermediate=1024,
    heads=6,
    kv_heads=2,
    head_dim=64,
    global_head_dim=128,
    global_kv_heads=1,
    sliding_window=64,  # twice the canvas, as in the tiny demo and the released model
    experts=8,
    experts_per_tok=2,
    moe_intermediate=256,
    canvas_length=32,
)
T = TypeVar("T")
# Prompt ids start above Gemma's special tokens (pad, eos, bos, turn and image markers).
FIRST_PLAIN_ID = 16


@dataclass
class Run:
    """One side's timed generations: tokens made, wall and CPU seconds per call."""

    tokens: list[int] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, tokens: int, wall: float, cpu: float) -> None:
        """Records one timed call."""
        self.tokens.append(tokens)
        self.wall.append(wall)
        self.cpu.append(cpu)

    def median(self) -> tuple[float, float]:
        """(tokens per wall second, tokens per CPU second): medians over the calls."""
        return (
            statistics.median(t / w for t, w in zip(self.tokens, self.wall, strict=True)),
            statistics.median(t / c for t, c in zip(self.tokens, self.cpu, strict=True)),
        )


def timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """fn()'s result, wall seconds and CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """n distinct random prompts of LENGTH plain token ids (fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(FIRST_PLAIN_ID, vocab, (n, length), generator=gen).tolist()


class Reference:
    """transformers' DiffusionGemmaForBlockDiffusion with our decoding settings, no EOS."""

    def __init__(self, path: Path, decoding: Any, canvas: int) -> None:
        from transformers import DiffusionGemmaForBlockDiffusion
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            EntropyBoundSamplerConfig,
        )

        self.model = DiffusionGemmaForBlockDiffusion.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        self.canvas = canvas
        self.settings = dict(
            max_denoising_steps=decoding.max_denoising_steps,
            t_min=decoding.t_min,
            t_max=decoding.t_max,
            stability_threshold=decoding.stability_threshold,
            confidence_threshold=decoding.confidence_threshold,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=decoding.entropy_bound),
            # No EOS: every canvas is generated. No pad id: no token is counted as padding in
            # its tokens_per_forward.
            eos_token_id=None,
            pad_token_id=None,
        )

    def generate(self, prompts: list[list[int]], new: int, seed: int) -> tuple[list[Any], float]:
        """(generated ids per row, denoising steps per canvas) of one `generate` call."""
        torch.manual_seed(seed)
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = self.model.generate(ids, max_new_tokens=new, **self.settings)
        tokens = out.sequences[:, ids.shape[1] :]
        assert tokens.shape[1] >= new, "transformers stopped early"
        # tokens_per_forward = generated tokens / decoder forwards (no pad id: all count).
        steps = float(self.canvas / out.tokens_per_forward.float().mean())
        return [row[:new].tolist() for row in tokens], steps


def describe(config: Any, prompt: int, new: int) -> str:
    """One line on the checkpoint and the work each request does."""
    full = sum(kind == "full_attention" for kind in config.layer_types)
    d = config.decoding
    return (
        f"vocab {config.vocab_size}, hidden {config.hidden_size}, intermediate "
        f"{config.intermediate_size}, {config.num_layers} layers ({config.num_layers - full} "
        f"sliding, {full} full), {config.num_heads} heads, {config.num_experts} experts top-"
        f"{config.top_k_experts} (moe_intermediate {config.moe_intermediate_size}), canvas "
        f"{config.canvas_length}; fp32; {prompt}-token prompts, {new} new tokens "
        f"({-(-new // config.canvas_length)} canvases); decoding: max {d.max_denoising_steps} "
        f"denoising steps, t {d.t_max}->{d.t_min}, entropy bound {d.entropy_bound}, stability "
        f"{d.stability_threshold}, confidence {d.confidence_threshold}, no EOS"
    )


def rate(wall_cpu: tuple[float, float]) -> str:
    """'W tokens/s (C per CPU-s)'."""
    return f"{wall_cpu[0]:8.1f} ({wall_cpu[1]:6.1f}/CPU-s)"


def ratio(ours: tuple[float, float], theirs: tuple[float, float]) -> str:
    """'Rx (Cx by CPU)'."""
    return f"{ours[0] / theirs[0]:5.2f}x ({ours[1] / theirs[1]:.2f}x by CPU)"


@dataclass
class Figures:
    """Everything one run measured, for the table."""

    ours_one: Run = field(default_factory=Run)
    ref_one: Run = field(default_factory=Run)
    ours_many: Run = field(default_factory=Run)
    ref_many: Run = field(default_factory=Run)
    our_steps: list[int] = field(default_factory=list)  # per canvas, batch 1
    ref_steps: list[float] = field(default_factory=list)  # per canvas, mean of a request
    tokens_per_forward: list[float] = field(default_factory=list)  # ours, batched
    per_denoising_forward: list[float] = field(default_factory=list)  # ours, batched
    same_as_reference: int = 0  # batch-1 requests whose tokens equal transformers'
    same_batched: int = 0  # requests whose batched tokens equal their batch-1 tokens


def measure(llm: Any, ref: Reference, prompts: list[list[int]], args: Any) -> Figures:
    """Batch 1 (alternating sides, prompt by prompt), then the batched runs (alternating)."""
    from engine import SamplingParams

    def ours(batch: list[list[int]], new: int, first_seed: int = 0) -> Any:
        # Request i's seed is its prompt's index in both of our runs and in transformers'.
        params = [
            SamplingParams(max_tokens=new, seed=first_seed + i, ignore_eos=True)
            for i in range(len(batch))
        ]
        return llm.generate(batch, params)

    canvas = llm.config.canvas_length
    # Warm-up, both batch shapes, both sides: first calls allocate and pick kernels.
    ours(prompts, canvas)
    ref.generate(prompts[:1], canvas, 0)
    ref.generate(prompts, canvas, 0)

    fig = Figures()
    single_tokens: list[list[int]] = []
    for seed, prompt in enumerate(prompts[: args.singles]):
        (out,), wall, cpu = timed(partial(ours, [prompt], args.new, seed))
        fig.ours_one.add(len(out.token_ids), wall, cpu)
        single_tokens.append(out.token_ids)
        fig.our_steps.extend(out.stats.steps_per_block)
        (theirs, steps), wall, cpu = timed(partial(ref.generate, [prompt], args.new, seed))
        fig.ref_one.add(len(theirs[0]), wall, cpu)
        fig.ref_steps.append(steps)
        fig.same_as_reference += theirs[0] == out.token_ids

    for _ in range(args.repeats):
        outs, wall, cpu = timed(partial(ours, prompts, args.new))
        assert all(len(o.token_ids) == args.new for o in outs), "ours stopped early"
        fig.ours_many.add(sum(len(o.token_ids) for o in outs), wall, cpu)
        alone = zip(single_tokens, outs[: len(single_tokens)], strict=True)
        fig.same_batched = sum(tokens == o.token_ids for tokens, o in alone)
        fig.tokens_per_forward = [o.stats.tokens_per_forward for o in outs]
        fig.per_denoising_forward = [len(o.token_ids) / sum(o.stats.steps_per_block) for o in outs]
        (rows, _), wall, cpu = timed(partial(ref.generate, prompts, args.new, 0))
        fig.ref_many.add(sum(len(r) for r in rows), wall, cpu)
    return fig


def print_table(fig: Figures, args: Any, canvas: int) -> None:
    """Ours, transformers' and the ratios; then the evidence that both did the same work."""
    b1, ref_b1 = fig.ours_one.median(), fig.ref_one.median()
    agg, ref_seq, ref_batched = fig.ours_many.median(), ref_b1, fig.ref_many.median()
    n = args.batch
    print(f"{'':34}{'ours tokens/s':>28}{'transformers tokens/s':>28}   ratio")
    print(
        f"{f'batch 1 (median of {args.singles})':34}{rate(b1):>28}{rate(ref_b1):>28}   "
        f"{ratio(b1, ref_b1)}  goal >= 2x"
    )
    print(
        f"{f'batch {n} aggregate, one by one':34}{rate(agg):>28}{rate(ref_seq):>28}   "
        f"{ratio(agg, ref_seq)}  goal >= 5x"
    )
    print(
        f"{f'batch {n} aggregate, batched gen.':34}{'':>28}{rate(ref_batched):>28}   "
        f"{ratio(agg, ref_batched)}  (theirs in one generate call)"
    )
    print(
        f"ours batch {n}: median of {args.repeats} runs; transformers one by one: its batch-1 "
        f"median (the reported ratio); transformers batched: median of {args.repeats} runs"
    )
    steps, ref_steps = fig.our_steps, statistics.median(fig.ref_steps)
    print(
        f"steps per canvas: ours median {statistics.median(steps):.1f} (min {min(steps)}, "
        f"max {max(steps)}), transformers median {ref_steps:.1f}; tokens per forward (ours, "
        f"batch {n}, encoder forwards included): {statistics.median(fig.tokens_per_forward):.2f}"
        f"; tokens per denoising forward: ours "
        f"{statistics.median(fig.per_denoising_forward):.2f}, transformers "
        f"{canvas / ref_steps:.2f}"
    )
    print(
        f"same tokens as transformers at batch 1: {fig.same_as_reference}/{args.singles}; "
        f"ours at batch {n} the same as at batch 1: {fig.same_batched}/{args.singles} "
        "(a random model is chaotic: a batched matmul's rounding can change a draw)"
    )


def run(path: Path, args: argparse.Namespace) -> None:
    """Both sides on the checkpoint at PATH: timings, then the table."""
    from engine import LLM
    from engine.families.diffusion_gemma.config import DiffusionGemmaConfig

    llm = LLM(
        path,
        dtype=torch.float32,
        max_batch_size=args.batch,
        max_seq_len=args.prompt + args.new + 64,
    )
    config = llm.config
    if not isinstance(config, DiffusionGemmaConfig):
        raise SystemExit(f"{path}: not a DiffusionGemma checkpoint (config.json's model_type)")
    print(f"checkpoint: {describe(config, args.prompt, args.new)}")
    ref = Reference(path, config.decoding, config.canvas_length)
    prompts = make_prompts(args.batch, args.prompt, config.vocab_size)
    print_table(measure(llm, ref, prompts, args), args, config.canvas_length)


def main(argv: list[str] | None = None) -> None:
    """Parses the options, builds (or takes) the checkpoint, runs and prints."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds, for the tests")
    parser.add_argument("--threads", type=int, default=None, help="default 2 (smoke: 1)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a DiffusionGemma dir")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (64)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per request (128)")
    parser.add_argument("--batch", type=int, default=None, help="the batched size (16)")
    parser.add_argument("--singles", type=int, default=None, help="batch-1 requests (8)")
    parser.add_argument("--repeats", type=int, default=None, help="batched repeats (3)")
    args = parser.parse_args(argv)
    small = {"threads": 1, "prompt": 12, "new": 32, "batch": 4, "singles": 2, "repeats": 1}
    full = {"threads": 2, "prompt": 64, "new": 128, "batch": 16, "singles": 8, "repeats": 3}
    for key, value in (small if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.singles = min(args.singles, args.batch)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    print(
        f"engine generate vs transformers generate(), diffusion-gemma: torch threads "
        f"{torch.get_num_threads()} (interop {torch.get_num_interop_threads()}) for both sides, "
        "one process"
    )
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.checkpoint is not None:
        print(f"checkpoint: {args.checkpoint}")
        run(args.checkpoint, args)
    else:
        shape, name = (TINY, "the tiny demo's") if args.smoke else (BENCH_SHAPE, "the benchmark")
        print(f"checkpoint: random weights, {name} shape, written by the demo writer")
        with tempfile.TemporaryDirectory() as tmp:
            run(create_diffusion_gemma_demo(Path(tmp) / "dg", shape=shape), args)
    after = os.getloadavg()
    print(f"load average after: {' '.join(f'{x:.1f}' for x in after)}")
    cores = os.cpu_count() or 1
    if max(after[:2]) > cores:
        # Oversubscribed: both clocks lie (OpenMP threads spin while they wait for a core).
        print(f"warning: more runnable processes than the {cores} cores during the run; rerun")


if __name__ == "__main__":
    main()
