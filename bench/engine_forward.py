"""Engine forward speed against transformers, same weights, same inputs, same run (CPU).

Config (the engine issues' benchmark config): vocab 32000, hidden 512, intermediate 1024,
moe_intermediate 256, 8 layers, 8 heads, 2 kv heads, head_dim 64, 16 experts, top-2, random
weights, saved once with transformers' `save_pretrained` and loaded by both sides.

(a) prefill of a 512-token prompt: ours writes the KV cache and computes logits of the last
    position only; transformers runs its forward with a cache, once computing all logits and
    once with `logits_to_keep=1` (the goal: ours no slower than the latter).
(b) denoising step: a 32-token block (positions 512..543, bidirectional inside the block)
    against the 512-token cache; the mean over the 8 steps of one steps-mode block with
    steps=8 (32, 28, ..., 4 positions still masked; ours computes logits only for those).
    transformers runs the same block against a fresh copy of its prefill cache each step
    (the copy is not timed) and computes all 32 rows. Goal: ours <= 0.5x transformers in bf16.

(c) the matmul-rate floor of (b): the step's arithmetic (projections, attention, the experts
    its tokens are routed to, the LM head rows) divided by the rate this machine multiplies a
    32- and a 64-row matrix by a hidden x 2*moe_intermediate one in the same dtype (the faster
    of the two): what a step would cost if nothing but its matmuls ran, at that rate. Goal: our
    step within 2x of it.

Ours loads as serving does (`packed_weights="auto"`: oneDNN-packed weights where the CPU
computes the dtype natively); `--packed-weights off|on` compares the layouts.
Figures are medians over repeats; 2 threads (`torch.set_num_threads(2)`).
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from engine.packing import PackPolicy

BENCH_CONFIG: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    # Diffusion fields (transformers keeps unknown keys in config.json; our loader reads them).
    "mask_token_id": 31999,
    "block_size": 32,
}
SMOKE_CONFIG: dict[str, Any] = {
    **BENCH_CONFIG,
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "num_experts": 4,
    "mask_token_id": 999,
}


Timed = tuple[Callable[[], Any], Callable[[], Any] | None]


# The clock medians use: wall time by default; `--clock thread` (1 thread, CPU time of this
# thread) gives figures a busy shared machine cannot inflate.
CLOCK: Callable[[], float] = time.perf_counter
PACKED: PackPolicy = "auto"


def median_ms(cases: dict[str, Timed], repeats: int) -> dict[str, float]:
    """Median time (ms, CLOCK) of each case's fn over `repeats` runs after one warm-up.

    Cases run round-robin, so a busy machine slows ours and transformers alike and the ratios
    stay meaningful; each case's setup (e.g. copying a cache) runs untimed before it.
    """
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(repeats + 1):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            start = CLOCK()
            fn()
            if i:
                times[name].append((CLOCK() - start) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def build_checkpoint(config: dict[str, Any], path: Path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).save_pretrained(path)


def run_dtype(path: Path, dtype: torch.dtype, prompt: int, block: int, steps: int, repeats: int):
    from transformers import AutoModelForCausalLM

    from engine.kv_cache import KVCache
    from engine.loader import load_sdar_model

    ours = load_sdar_model(path, dtype=dtype, packed_weights=PACKED)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    vocab = ours.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, prompt), generator=gen)
    block_ids = torch.randint(0, vocab, (1, block), generator=gen)
    cache = KVCache(ours.config, 1, prompt + block, dtype=dtype)
    slot, zero, committed = torch.tensor([0]), torch.tensor([0]), torch.tensor([prompt])
    last = torch.tensor([prompt - 1])

    def ours_prefill() -> None:
        ours(ids, cache=cache, slots=slot, cache_lens=zero, write_cache=True, logits_rows=last)

    with torch.no_grad():
        res = median_ms(
            {
                "ours_prefill": (ours_prefill, None),
                "hf_prefill": (lambda: ref(ids, use_cache=True), None),
                "hf_prefill_keep1": (lambda: ref(ids, use_cache=True, logits_to_keep=1), None),
            },
            repeats,
        )
        hf_cache = ref(ids, use_cache=True).cache

    positions = torch.arange(prompt, prompt + block).view(1, -1)
    # Still-masked counts of a steps-mode block: block, block - block/steps, ...
    masked_counts = [block - k * (block // steps) for k in range(steps)]

    def ours_block() -> None:
        for m in masked_counts:
            rows = torch.arange(block - m, block)
            ours(
                block_ids,
                positions,
                block_size=block,
                cache=cache,
                slots=slot,
                cache_lens=committed,
                logits_rows=rows,
            )

    # The whole block attends to the whole prompt and to itself (one block, bidirectional).
    open_mask = torch.zeros(1, 1, block, prompt + block, dtype=dtype)
    copies: list[Any] = []

    def fresh_caches() -> None:
        copies[:] = [copy.deepcopy(hf_cache) for _ in masked_counts]

    def hf_block() -> None:
        for c in copies:
            ref(block_ids, position_ids=positions, cache=c, attention_mask=open_mask)

    with torch.no_grad():
        blocks = median_ms({"ours": (ours_block, None), "hf": (hf_block, fresh_caches)}, repeats)
    res["ours_step"], res["hf_step"] = blocks["ours"] / steps, blocks["hf"] / steps
    res["packed"] = float(ours.packed)
    res["weights_mib"] = ours.weight_bytes() / 2**20
    res["cache_mib"] = (
        sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values)) / 2**20
    )
    res["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["step_gflop"] = step_flops(ours.config, prompt, block, masked_counts) / 1e9
    res["gflops"] = matmul_rate(ours.config, ours.compute_dtype, block, repeats)
    res["floor"] = res["step_gflop"] / res["gflops"] * 1000
    return res


def step_flops(cfg: Any, prompt: int, block: int, masked_counts: list[int]) -> float:
    """Multiply-add FLOPs of one denoising step (mean over the block's steps): every layer's
    projections and attention for the whole block, the experts its tokens go to, the LM head
    for the still-masked rows."""
    h, t = cfg.hidden_size, block
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * t * h * (q + 2 * kv) + 2 * t * q * h
    per_layer += 2 * 2 * t * (prompt + t) * q  # scores and weighted values, every head
    if cfg.num_experts:
        k, i = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        per_layer += 2 * t * h * cfg.num_experts + 2 * t * k * 3 * h * i
    else:
        per_layer += 2 * t * 3 * h * cfg.intermediate_size
    head = 2 * statistics.mean(masked_counts) * h * cfg.vocab_size
    return cfg.num_layers * per_layer + head


def matmul_rate(cfg: Any, dtype: torch.dtype, block: int, repeats: int) -> float:
    """GFLOP/s of this machine on the step's matmul shape class: a block-sized (and twice
    that) row count times a hidden x 2*moe_intermediate weight, the faster of the two."""
    out = 2 * (cfg.moe_intermediate_size or cfg.intermediate_size)
    weight = torch.randn(out, cfg.hidden_size).to(dtype)
    best = 0.0
    for rows in (block, 2 * block):
        x = torch.randn(rows, cfg.hidden_size).to(dtype)

        def product(x: torch.Tensor = x) -> None:
            for _ in range(20):
                torch.nn.functional.linear(x, weight)

        ms = median_ms({"mm": (product, None)}, max(repeats, 3))["mm"] / 20
        best = max(best, 2 * rows * cfg.hidden_size * out / (ms / 1000) / 1e9)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds, for the tests")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--packed-weights", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="thread: one thread, CPU time of the calling thread (robust on a shared machine)",
    )
    args = parser.parse_args(argv)
    global CLOCK, PACKED
    PACKED = cast(PackPolicy, args.packed_weights)
    if args.clock == "thread":
        CLOCK, args.threads = time.thread_time, 1
    torch.set_num_threads(args.threads)
    config = SMOKE_CONFIG if args.smoke else BENCH_CONFIG
    prompt, block, steps = (64, 8, 4) if args.smoke else (512, 32, 8)
    repeats = 1 if args.smoke else args.repeats
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    print(
        f"engine forward vs transformers: {'smoke' if args.smoke else 'benchmark'} config, "
        f"prefill {prompt} tokens, {block}-token block x {steps} steps, "
        f"{args.threads} threads, {args.clock} clock, median of {repeats}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(config, Path(tmp))
        for name in args.dtypes.split(","):
            r = run_dtype(Path(tmp), dtypes[name], prompt, block, steps, repeats)
            print(
                f"[{name}] (a) prefill: ours {r['ours_prefill']:.1f} ms | transformers "
                f"{r['hf_prefill']:.1f} ms (all logits), {r['hf_prefill_keep1']:.1f} ms "
                f"(logits_to_keep=1) | ratio {r['ours_prefill'] / r['hf_prefill']:.2f}x, "
                f"{r['ours_prefill'] / r['hf_prefill_keep1']:.2f}x vs keep1 (goal <= 1.00x)"
            )
            print(
                f"[{name}] (b) denoising step: ours {r['ours_step']:.1f} ms | transformers "
                f"{r['hf_step']:.1f} ms | ratio {r['ours_step'] / r['hf_step']:.2f}x"
                + (" (goal <= 0.50x)" if name == "bf16" else "")
                + (" | weights packed" if r["packed"] else " | weights plain")
            )
            print(
                f"[{name}] memory: our weights {r['weights_mib']:.1f} MiB, KV cache "
                f"{r['cache_mib']:.1f} MiB; peak RSS of this process so far {r['rss_mib']:.0f} MiB "
                "(both models)"
            )
            print(
                f"[{name}] (c) matmul-rate floor of (b): {r['step_gflop']:.3g} GFLOP at "
                f"{r['gflops']:.0f} GFLOP/s = {r['floor']:.1f} ms | ours / floor "
                f"{r['ours_step'] / r['floor']:.2f}x (goal <= 2x)"
            )


if __name__ == "__main__":
    main()
