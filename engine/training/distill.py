"""Self-distillation: the autoregressive phase's own greedy continuations as training text.

Why: parallel unmasking accepts a position only when the model is sure of it without knowing the
masked positions before it. On real text the second and third next words have many plausible
values (the "multimodality" of non-autoregressive decoding), so a small model is rarely sure of
them. Its own greedy text has one continuation per prefix: trained on it, the block-diffusion
model learns to be sure several positions ahead. This is sequence-level knowledge distillation
(Kim and Rush, 2016; Gu et al., 2018, for non-autoregressive translation), and the
self-distillation dParallel (Chen et al., 2025) and CLLMs (Kou et al., 2024) use to cut the
denoising steps of diffusion and Jacobi decoding.

The teacher is the checkpoint the autoregressive phase wrote, run by our own engine with block
size 1 (exactly autoregressive decoding with a KV cache), greedy. Prompts come from the training
chapters only: chat turns whose user message is a verse (as in the training documents, thinking
off as the demo is served) and prose continuations of a verse. The held-out chapters and the
shipped prompts are never used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.llm import LLM
from engine.params import SamplingParams
from engine.training.corpus import Chapter

# Prompts decoded together: the engine batches them, so more is faster up to the CPU's width.
BATCH = 64


@dataclass(frozen=True)
class DistillPrompt:
    """One teacher prompt: a verse as a chat message, or a verse to continue as prose."""

    text: str
    chat: bool


def distill_prompts(chapters: list[Chapter], count: int, seed: int) -> list[DistillPrompt]:
    """`count` prompts drawn from the training chapters' verses: two chats for each prose one."""
    rng = random.Random(seed)
    verses = [v for c in chapters for v in c.verses]
    picks = rng.sample(range(len(verses)), min(count, len(verses)))
    return [DistillPrompt(verses[i], chat=n % 3 != 2) for n, i in enumerate(picks)]


def teacher_token_stream(
    checkpoint: Path, prompts: list[DistillPrompt], max_tokens: int, threads: int
) -> torch.Tensor:
    """The teacher's documents (prompt, greedy continuation, end marker when it ended) as one
    token stream, in prompt order."""
    torch.set_num_threads(threads)
    llm = LLM(checkpoint, dtype="float32", max_batch_size=BATCH, max_seq_len=512)
    tokenizer = llm.tokenizer
    # The ends the training documents write (see `corpus.documents`); EOS itself is not output.
    chat_end = [_special(tokenizer.token_to_id("<|im_end|>")), *tokenizer.encode("\n")]
    prose_end = [_special(tokenizer.token_to_id("<|endoftext|>"))]
    params = SamplingParams(max_tokens=max_tokens, block_size=1, thinking=False)
    ids: list[int] = []
    for start in range(0, len(prompts), BATCH):
        chunk = prompts[start : start + BATCH]
        encoded = [
            tokenizer.encode_chat([{"role": "user", "content": p.text}], enable_thinking=False)
            if p.chat
            else tokenizer.encode(p.text)
            for p in chunk
        ]
        for prompt, ids_in, out in zip(chunk, encoded, llm.generate(encoded, params), strict=True):
            ids += ids_in + out.token_ids
            if out.finish_reason == "stop":
                ids += chat_end if prompt.chat else prose_end
    return torch.tensor(ids, dtype=torch.long)


def _special(token_id: int | None) -> int:
    if token_id is None:
        raise ValueError("the teacher's tokenizer lacks the chat markers of the demo model")
    return token_id
