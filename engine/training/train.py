"""Train the demo model: `python -m engine.training.train --bible kjv.txt --out DIR`.

Reproducible: the text is pinned by digest (see `corpus`), every random choice comes from
`--seed`, and torch runs deterministic CPU kernels on a fixed number of threads. The defaults
(an autoregressive phase, self-distillation, a block-diffusion phase: see `Recipe`) take 85-95
minutes on a 2-core CPU. The output directory is a complete
checkpoint (bf16 safetensors, config, tokenizer with the Qwen3 chat template, generation config)
plus `training.json` (the figures measured here), the held-out text and the corpus's word list;
the model card (`README.md`) is written from those figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.demo_checkpoint import (
    SPECIAL_TOKENS,
    THINK_TOKENS,
    DemoShape,
    checkpoint_config,
    write_json,
    write_tokenizer,
)
from engine.model import Model, MoE
from engine.training.corpus import (
    HELD_OUT_EVERY,
    KJV_VERSES_SHA256,
    Chapter,
    documents,
    load_bible,
    split,
)
from engine.training.distill import distill_prompts, teacher_token_stream
from engine.training.export import hf_state_dict
from engine.training.objective import block_diffusion_loss, corrupt, masked_logits

SHAPE = DemoShape(
    # + 2 thinking markers = 1024 rows, no padding. A small vocabulary splits words into
    # pieces whose continuations are nearly certain, which is where parallel unmasking pays.
    bpe_vocab=1022,
    hidden=256,
    layers=4,
    heads=8,
    kv_heads=2,
    head_dim=32,
    experts=8,
    experts_per_tok=2,
    moe_intermediate=256,
    intermediate=768,
    block_size=16,
    max_positions=4096,
    dtype="bfloat16",
)
# Every diffusion step trains one block size, in turn: the model decodes well at each size
# `dctl tune` sweeps, not only at the default.
BLOCK_SIZES = (4, 8, 16, 32)
# The autoregressive phase trains block size 1: next-token prediction in the same
# [noisy | clean] formulation (BD3-LM: B = 1 is AR), so no head or position shift has to be
# unlearned afterwards. It is SDAR's recipe (an AR model converted to block diffusion by
# continued training), and every position is a target: twice the signal per forward of the
# uniform masks, all of it on the left-to-right prediction threshold decoding leans on.
AR_BLOCK = 1
BALANCE_WEIGHT = 0.01


@dataclass(frozen=True)
class Recipe:
    """The training run's settings (recorded in the model card). The defaults reproduce the
    shipped model: an autoregressive phase, the teacher's greedy text (`distill`), then the
    block-diffusion conversion on real and distilled text."""

    seed: int = 0
    ar_steps: int = 1200  # the autoregressive phase: block size 1
    steps: int = 800  # the block-diffusion phase: BLOCK_SIZES in turn
    batch: int = 16
    seq_len: int = 256
    peak_lr: float = 3e-3  # the AR phase's peak; each phase warms up and decays on its own
    diffusion_lr: float = 1.5e-3  # the diffusion phase's: a conversion, not a new start
    warmup: int = 50
    weight_decay: float = 0.1
    threads: int = 2
    eval_windows: int = 64
    # Teacher prompts decoded after the AR phase (0: no distillation) and the tokens each may add.
    distill_prompts: int = 3072
    distill_tokens: int = 96
    distill_share: float = 0.75  # share of the diffusion phase's windows from the teacher
    suffix_share: float = 0.5  # share of diffusion blocks masked as a suffix (see `corrupt`)
    # The books trained on (None: the whole Bible).
    books: tuple[str, ...] | None = None
    # "cpu" (the shipped recipe) or "cuda". CUDA kernels are deterministic where torch has a
    # deterministic version (the others warn), so a GPU run repeats on the same GPU and torch,
    # not bit for bit on another.
    device: str = "cpu"


def learning_rate(peak: float, warmup: int, steps: int, step: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it by step `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def initialise(model: Model, gen: torch.Generator) -> None:
    """N(0, 0.02) matrices (output projections scaled down by depth, GPT-2 style), unit norms."""
    depth_scale = 1 / math.sqrt(2 * len(model.layers))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                std = 0.02 * (depth_scale if name.endswith(("wo.weight", "w_down")) else 1.0)
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def token_stream(tokenizer: Any, docs: list[str]) -> torch.Tensor:
    """All documents' tokens, concatenated (documents carry their own end markers)."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(
    model: Model, held: torch.Tensor, mask_token_id: int, block: int, seed: int
) -> tuple[float, float]:
    """(masked-token loss, accuracy) on fixed held-out windows with a fixed masking."""
    gen = torch.Generator().manual_seed(seed)
    total_loss, total_right, total = 0.0, 0, 0
    dev = model.device
    for rows in held.split(16):
        noisy, masked = corrupt(rows, block, mask_token_id, gen)
        rows, noisy, masked = rows.to(dev), noisy.to(dev), masked.to(dev)
        logits = masked_logits(model, rows, noisy, masked, block)
        targets = rows[masked]
        total_loss += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        total_right += int((logits.argmax(dim=-1) == targets).sum())
        total += targets.numel()
    return total_loss / total, total_right / total


def held_out_windows(tokenizer: Any, chapters: list[Chapter], recipe: Recipe) -> torch.Tensor:
    """Fixed, non-overlapping windows of the held-out chapters' documents."""
    stream = token_stream(tokenizer, documents(chapters, recipe.seed + 1))
    n = min(recipe.eval_windows, stream.numel() // recipe.seq_len)
    return stream[: n * recipe.seq_len].view(n, recipe.seq_len)


def word_list(chapters: list[Chapter]) -> list[str]:
    """Every word of the training text, lower-cased, sorted."""
    words = {w.lower() for c in chapters for v in c.verses for w in re.findall(r"[A-Za-z]+", v)}
    return sorted(words)


def train(bible: Path, out: Path, recipe: Recipe, log_every: int = 20) -> dict[str, Any]:
    """Train and write the checkpoint into `out` (a new or empty directory).

    The autoregressive phase trains block size 1 for `ar_steps`; its weights, saved to a scratch
    checkpoint, are the teacher whose greedy text (`distill`) joins the real text in the
    block-diffusion phase (`steps`). Each quarter of that phase also leaves a loadable checkpoint
    in `out/step-N`, so a run's progress can be measured while it trains."""
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    device = torch.device(recipe.device)
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace; set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; choose a new directory")
    out.mkdir(parents=True, exist_ok=True)
    chapters = load_bible(bible)
    if recipe.books is not None:
        known = list(dict.fromkeys(c.book for c in chapters))
        unknown = [b for b in recipe.books if b not in known]
        if unknown:
            raise SystemExit(f"--books: no book {unknown[0]!r} in the text; books: {known}")
        chapters = [c for c in chapters if c.book in recipe.books]
    train_chapters, held_chapters = split(chapters)
    verses = [v for c in train_chapters for v in c.verses]
    tokenizer = write_tokenizer(
        out, vocab_size=SHAPE.bpe_vocab, max_positions=SHAPE.max_positions, texts=verses
    )
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS + THINK_TOKENS}
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    config = checkpoint_config(SHAPE, vocab_size, ids)
    config["router_aux_loss_coef"] = BALANCE_WEIGHT
    cfg = ModelConfig.from_hf(config, None, tokenizer_mask_token_id=ids["<|mask|>"], source="demo")
    mask_id = ids["<|mask|>"]

    stream = token_stream(tokenizer, documents(train_chapters, recipe.seed))
    held = held_out_windows(tokenizer, held_chapters, recipe)
    gen = torch.Generator().manual_seed(recipe.seed)
    model = Model(cfg, dtype=torch.float32)
    # Initialised on the CPU from the seed, so a GPU run starts from the CPU run's weights.
    initialise(model, gen)
    model.to(device)
    before = evaluate(model, held, mask_id, 16, recipe.seed)
    print(
        f"tokens: train {stream.numel():,}, held-out {held.numel():,}; "
        f"parameters {sum(p.numel() for p in model.parameters()):,}; "
        f"held-out loss before training {before[0]:.3f}",
        flush=True,
    )
    started = time.monotonic()
    run = _Run(model, recipe, mask_id, gen, log_every)
    run.phase(
        "autoregressive",
        recipe.ar_steps,
        recipe.peak_lr,
        lambda step: AR_BLOCK,
        lambda: windows(stream, recipe.batch, recipe.seq_len, gen),
    )
    ar_minutes = (time.monotonic() - started) / 60
    teacher_tokens = 0
    draw = lambda: windows(stream, recipe.batch, recipe.seq_len, gen)  # noqa: E731
    if recipe.ar_steps and recipe.distill_prompts:
        with tempfile.TemporaryDirectory(prefix="dctl-teacher-") as scratch:
            teacher = Path(scratch)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (teacher / name).write_bytes((out / name).read_bytes())
            save_checkpoint(teacher, model, config, ids)
            prompts = distill_prompts(train_chapters, recipe.distill_prompts, recipe.seed + 2)
            distilled = teacher_token_stream(
                teacher, prompts, recipe.distill_tokens, recipe.threads
            )
        teacher_tokens = distilled.numel()
        print(f"teacher text: {teacher_tokens:,} tokens from {len(prompts)} prompts", flush=True)
        taught = round(recipe.batch * recipe.distill_share)

        def draw() -> torch.Tensor:
            return torch.cat(
                (
                    windows(distilled, taught, recipe.seq_len, gen),
                    windows(stream, recipe.batch - taught, recipe.seq_len, gen),
                )
            )

    quarter = max(1, recipe.steps // 4)
    run.phase(
        "block diffusion",
        recipe.steps,
        recipe.diffusion_lr,
        lambda step: BLOCK_SIZES[step % len(BLOCK_SIZES)],
        draw,
        snapshot=lambda step: (
            save_checkpoint(out / f"step-{step}", model, config, ids)
            if step % quarter == 0 and step < recipe.steps
            else None
        ),
    )
    minutes = (time.monotonic() - started) / 60
    after = evaluate(model, held, mask_id, 16, recipe.seed)
    print(
        f"held-out masked-token loss {before[0]:.3f} -> {after[0]:.3f}, "
        f"accuracy {before[1]:.3f} -> {after[1]:.3f}",
        flush=True,
    )

    save_checkpoint(out, model, config, ids)
    (out / "heldout.txt").write_text(
        "\n\n".join(" ".join(c.verses) for c in held_chapters) + "\n", encoding="utf-8"
    )
    (out / "words.txt").write_text("\n".join(word_list(train_chapters)) + "\n", encoding="utf-8")
    figures = {
        "recipe": asdict(recipe),
        "block_sizes": list(BLOCK_SIZES),
        "train_tokens": stream.numel(),
        "teacher_tokens": teacher_tokens,
        "parameters": sum(p.numel() for p in model.parameters()),
        "active_parameters": active_parameters(model),
        "heldout_loss_random": round(before[0], 4),
        "heldout_loss": round(after[0], 4),
        "heldout_accuracy_random": round(before[1], 4),
        "heldout_accuracy": round(after[1], 4),
        "autoregressive_minutes": round(ar_minutes, 1),
        "train_minutes": round(minutes, 1),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "corpus_sha256": KJV_VERSES_SHA256,
        "held_out_every": HELD_OUT_EVERY,
    }
    write_json(out / "training.json", figures)
    return figures


class _Run:
    """The model, its optimiser and the random stream, carried across the phases."""

    def __init__(
        self, model: Model, recipe: Recipe, mask_id: int, gen: torch.Generator, log_every: int
    ) -> None:
        self.model, self.recipe, self.mask_id, self.gen = model, recipe, mask_id, gen
        self.log_every = log_every
        matrices = [p for p in model.parameters() if p.dim() > 1]
        vectors = [p for p in model.parameters() if p.dim() == 1]
        self.optimiser = torch.optim.AdamW(
            [
                {"params": matrices, "weight_decay": recipe.weight_decay},
                {"params": vectors, "weight_decay": 0.0},
            ],
            lr=recipe.peak_lr,
            betas=(0.9, 0.95),
        )

    def phase(
        self,
        name: str,
        steps: int,
        peak_lr: float,
        block_for: Callable[[int], int],
        draw: Callable[[], torch.Tensor],
        snapshot: Callable[[int], None] | None = None,
    ) -> None:
        """`steps` optimiser steps on batches from `draw`, with a schedule of their own."""
        recipe, device = self.recipe, self.model.device
        started = time.monotonic()
        recent: list[float] = []
        for step in range(steps):
            block = block_for(step)
            lr = learning_rate(peak_lr, recipe.warmup, steps, step)
            for group in self.optimiser.param_groups:
                group["lr"] = lr
            clean = draw()
            # Suffix masks only where there is more than one position to mask.
            suffix = recipe.suffix_share if block > 1 else 0.0
            noisy, masked = corrupt(clean, block, self.mask_id, self.gen, suffix)
            clean, noisy, masked = clean.to(device), noisy.to(device), masked.to(device)
            losses = block_diffusion_loss(self.model, clean, noisy, masked, block)
            total = losses.diffusion + BALANCE_WEIGHT * losses.balance
            self.optimiser.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimiser.step()
            recent.append(float(losses.diffusion.detach()))
            if (step + 1) % self.log_every == 0 or step + 1 == steps:
                elapsed = time.monotonic() - started
                eta = elapsed / (step + 1) * (steps - step - 1)
                print(
                    f"{name} step {step + 1}/{steps} loss {sum(recent) / len(recent):.3f} "
                    f"balance {float(losses.balance.detach()):.3f} lr {lr:.2e} "
                    f"{elapsed / 60:.1f} min, {eta / 60:.1f} min left",
                    flush=True,
                )
                recent.clear()
            if snapshot is not None:
                snapshot(step + 1)


def save_checkpoint(out: Path, model: Model, config: dict[str, Any], ids: dict[str, int]) -> None:
    """Weights (bf16), config and generation config into `out`, with the tokenizer alongside
    when `out` is a snapshot subdirectory of the run (so it loads as a checkpoint of its own)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        source = out.parent / name
        if not (out / name).exists() and source.exists():
            (out / name).write_bytes(source.read_bytes())
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation_config(ids, seed=0))
    save_file(
        hf_state_dict(model, torch.bfloat16), str(out / "model.safetensors"), {"format": "pt"}
    )


def active_parameters(model: Model) -> int:
    """Parameters one token uses: everything but the experts it is not routed to."""
    total = sum(p.numel() for p in model.parameters())
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            per_expert = layer.mlp.w_gate_up[0].numel() + layer.mlp.w_down[0].numel()
            total -= per_expert * (layer.mlp.num_experts - layer.mlp.top_k)
    return total


def generation_config(ids: dict[str, int], *, seed: int) -> dict[str, Any]:
    """The generation config; `dctl_demo_seed` is the only field a demo seed changes."""
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "mask_token_id": ids["<|mask|>"],
        "block_size": SHAPE.block_size,
        "do_sample": False,
        "dctl_demo_seed": seed,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: the bible printout, the output directory, the recipe's knobs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--bible", type=Path, required=True, help="`bible gen1:1-rev22:21` output")
    parser.add_argument("--out", type=Path, required=True, help="new or empty directory")
    defaults = Recipe()
    parser.add_argument(
        "--ar-steps",
        type=int,
        default=defaults.ar_steps,
        help="autoregressive (block size 1) steps",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="block-diffusion steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--distill-prompts",
        type=int,
        default=defaults.distill_prompts,
        help="teacher prompts decoded after the AR phase (0: no distillation)",
    )
    parser.add_argument(
        "--distill-share",
        type=float,
        default=defaults.distill_share,
        help="share of the diffusion phase's windows from the teacher's text",
    )
    parser.add_argument(
        "--suffix-share",
        type=float,
        default=defaults.suffix_share,
        help="share of diffusion blocks masked as a suffix",
    )
    parser.add_argument("--books", help="comma-separated books to train on (default: all)")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="windows per step")
    parser.add_argument(
        "--lr", type=float, default=defaults.peak_lr, help="the AR phase's peak rate"
    )
    parser.add_argument(
        "--diffusion-lr",
        type=float,
        default=defaults.diffusion_lr,
        help="the diffusion phase's peak rate",
    )
    parser.add_argument("--device", default=defaults.device, help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    books = tuple(b.strip() for b in args.books.split(",")) if args.books else None
    recipe = Recipe(
        seed=args.seed,
        ar_steps=args.ar_steps,
        steps=args.steps,
        threads=args.threads,
        distill_prompts=args.distill_prompts,
        distill_share=args.distill_share,
        suffix_share=args.suffix_share,
        books=books,
        batch=args.batch,
        peak_lr=args.lr,
        diffusion_lr=args.diffusion_lr,
        device=args.device,
    )
    figures = train(args.bible, args.out, recipe)
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
