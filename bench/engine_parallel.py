"""One engine instance on 1 rank vs split over N ranks (`engine.parallel`): speed and memory.

Each side runs in a fresh process (`--side 1`, `--side N`), so its peak RSS is its own:
- load: peak RSS of every rank once the engine is built (rank 0's `ru_maxrss`; the other
  ranks' VmHWM, the same figure read from /proc, as they are the launcher's grandchildren),
  against the single process's. The issue's bar: each of 2 ranks at most 60% of the single
  process's peak;
- decode: a fixed batch (`--batch` requests of `--prompt` tokens, `--max-tokens` each, steps
  mode, greedy, EOS ignored) driven through `EngineCore.step` as the server's engine thread
  does; tokens/s (generated tokens / wall time), the median step time, and the communication
  share of the step: the time rank 0 spends inside collectives (the model's all-reduces,
  gathers and scatters, and the step's message to the other ranks; timed around each call,
  after a CUDA synchronize on GPUs) over the whole step. Waiting for a slower rank counts as
  communication, as it does for the step. Medians over `--repeats` runs after one warm-up.

CPU (the default): gloo, and the same cores for both sides: each of N ranks gets its share of
`--threads` (default: every core of this process; at least 1), as `engine.serve` does; the
single process runs twice, with all of them and with one rank's share (on small shared VMs
more torch threads can be slower, so the ratio is taken against the faster single run).
`--device cuda`: NCCL, one GPU per rank (CUDA_VISIBLE_DEVICES), the same script.

The checkpoint: the demo's Qwen3-MoE layout at a bench shape (`BENCH_SHAPE`, about 100 M
parameters, fp32, ~400 MB), written once into a temporary directory (`--checkpoint DIR`
reuses one).

    .venv/bin/python -m bench.engine_parallel            # 1 vs 2 ranks on this CPU
    .venv/bin/python -m bench.engine_parallel --device cuda --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BENCH_SHAPE = {
    "bpe_vocab": 1024,
    "hidden": 768,
    "layers": 6,
    "heads": 12,
    "kv_heads": 4,
    "head_dim": 64,
    "experts": 8,
    "experts_per_tok": 2,
    "moe_intermediate": 768,
    "intermediate": 2048,
    "block_size": 32,
    "max_positions": 4096,
    "dtype": "float32",
}
TIMED_COLLECTIVES = ("all_reduce", "gather", "scatter", "broadcast_object_list")


def write_checkpoint(directory: Path) -> Path:
    """The bench checkpoint (module docstring) in DIRECTORY."""
    from engine import demo_checkpoint

    demo_checkpoint.SHAPES["bench"] = demo_checkpoint.DemoShape(**BENCH_SHAPE)  # type: ignore[arg-type]
    return demo_checkpoint.create_demo_checkpoint(directory, seed=0, size="bench")


def peak_rss_mb(pid: int | None = None) -> float:
    """Peak RSS in MB of this process (ru_maxrss) or of PID (VmHWM)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


class CollectiveClock:
    """Seconds rank 0 spends inside `torch.distributed` collectives, while `timing()`."""

    def __init__(self, synchronize: Callable[[], None]) -> None:
        self.seconds = 0.0
        self._synchronize = synchronize

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Wraps the collectives the parallel model calls (its modules' `dist` functions)."""
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in TIMED_COLLECTIVES}

        def timed(call: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                self._synchronize()
                start = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    self._synchronize()
                    self.seconds += time.perf_counter() - start

            return run

        for name, call in originals.items():
            setattr(dist, name, timed(call))
        try:
            yield
        finally:
            for name, call in originals.items():
                setattr(dist, name, call)


def decode_batch(core: Any, args: argparse.Namespace, vocab: int) -> tuple[float, list[float]]:
    """One fixed batch to the end: (wall seconds, each step's seconds)."""
    from engine.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, steps=args.steps, ignore_eos=True, temperature=0.0
    )
    for i in range(args.batch):
        prompt = [(17 * i + 31 * j) % (vocab - 64) + 8 for j in range(args.prompt)]
        core.add_request(f"r{i}", prompt, params)
    steps: list[float] = []
    start = time.perf_counter()
    while core.has_unfinished():
        began = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - began)
    return time.perf_counter() - start, steps


def run_side(args: argparse.Namespace) -> dict[str, Any]:
    """One side in this process (`--side`): the figures as a dict."""
    import torch

    from engine.factory import EngineOptions, build_engine

    ranks = args.side
    threads = max(1, args.threads // ranks)
    torch.set_num_threads(threads)
    cuda = args.device == "cuda"
    options = EngineOptions(
        dtype="fp32", device=args.device, max_batch_size=args.batch, max_seq_len=1024,
        threads=threads,
    )  # fmt: skip
    local = None
    if ranks > 1:
        from engine.parallel.launcher import start_local_group

        local = start_local_group(ranks, threads=threads, log_level="warning")
    try:
        built = build_engine(args.checkpoint, options, group=local.group if local else None)
        rss = [peak_rss_mb()]
        if local is not None:
            rss += [peak_rss_mb(w.pid) for w in local.workers]
        vocab = built.config.vocab_size
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        clock = CollectiveClock(sync)
        decode_batch(built.core, args, vocab)  # warm-up
        walls, steps, shares = [], [], []
        for _ in range(args.repeats):
            clock.seconds = 0.0
            with clock.timing():
                wall, step_times = decode_batch(built.core, args, vocab)
            walls.append(wall)
            steps += step_times
            shares.append(clock.seconds / sum(step_times))
        tokens = args.batch * args.max_tokens
        return {
            "ranks": ranks,
            "threads_per_rank": threads,
            "backend": local.group.backend if local else "-",
            "load_peak_rss_mb": [round(r) for r in rss],
            "tokens_per_s": tokens / statistics.median(walls),
            "step_ms": 1000 * statistics.median(steps),
            "comm_share": statistics.median(shares) if local else 0.0,
        }
    finally:
        if local is not None:
            local.close()


def main(argv: list[str] | None = None) -> int:
    """Both sides, each in its own process, then the table and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the split side")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads in all")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per block")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--side", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds, for the tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.prompt, args.max_tokens, args.steps, args.repeats = 2, 8, 8, 2, 1
    args.threads = args.threads or len(os.sched_getaffinity(0))
    if args.side is not None:
        print(json.dumps(run_side(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        if args.checkpoint is None and args.smoke:
            from engine.demo_checkpoint import create_demo_checkpoint

            args.checkpoint = create_demo_checkpoint(Path(tmp) / "tiny", seed=0, size="tiny")
        elif args.checkpoint is None:
            args.checkpoint = write_checkpoint(Path(tmp) / "bench")
        given = list(argv if argv is not None else sys.argv[1:])
        forwarded = [a for i, a in enumerate(given) if not a.startswith("--threads")
                     and not (i and given[i - 1] == "--threads") and a != "--smoke"]  # fmt: skip
        if args.smoke:
            forwarded += ["--batch", "2", "--prompt", "8", "--max-tokens", "8", "--steps", "2",
                          "--repeats", "1"]  # fmt: skip
        share = max(1, args.threads // args.ranks)
        results = []
        for side, threads in ((1, args.threads), (1, share), (args.ranks, args.threads)):
            command = [sys.executable, "-m", "bench.engine_parallel", *forwarded,
                       "--side", str(side), "--threads", str(threads),
                       "--checkpoint", str(args.checkpoint)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stdout, done.stderr, file=sys.stderr)
                return 1
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    split = results[-1]
    one = max(results[:-1], key=lambda r: r["tokens_per_s"])
    print(f"device {args.device}, batch {args.batch} x {args.max_tokens} tokens (prompt "
          f"{args.prompt}, {args.steps} steps per block), medians of {args.repeats}")  # fmt: skip
    print(f"{'ranks':>5} {'backend':>7} {'threads':>7} {'tokens/s':>9} {'step ms':>8} "
          f"{'comm %':>7}  load peak RSS MB per rank")  # fmt: skip
    for r in results:
        print(f"{r['ranks']:>5} {r['backend']:>7} {r['threads_per_rank']:>7} "
              f"{r['tokens_per_s']:>9.1f} {r['step_ms']:>8.1f} {100 * r['comm_share']:>6.1f}%  "
              f"{r['load_peak_rss_mb']}")  # fmt: skip
    worst = max(split["load_peak_rss_mb"]) / one["load_peak_rss_mb"][0]
    speed = split["tokens_per_s"] / one["tokens_per_s"]
    print(f"ratio {args.ranks} ranks / 1 (its {one['threads_per_rank']}-thread run): "
          f"tokens/s {speed:.2f}x, "
          f"step time {split['step_ms'] / one['step_ms']:.2f}x, "
          f"largest rank's load peak RSS {100 * worst:.0f}% of the single process's "
          f"(bar: 60% for 2 ranks)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
