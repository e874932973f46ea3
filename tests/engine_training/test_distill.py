"""Self-distillation: the teacher's text is its own greedy autoregressive continuation of
training prompts, assembled as the training documents are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.demo_checkpoint import create_demo_checkpoint
from engine.loader import load_model, load_tokenizer
from engine.training.corpus import Chapter
from engine.training.distill import DistillPrompt, distill_prompts, teacher_token_stream
from engine.training.objective import masked_logits

MASK_ID = 3
IM_END = 2  # <|im_end|> in the demo tokenizer
ENDOFTEXT = 0


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_demo_checkpoint(tmp_path_factory.mktemp("teacher") / "ckpt", seed=3)


def greedy_block_one(checkpoint: Path, prompt: list[int], new: int) -> tuple[list[int], bool]:
    """The reference decode, independent of the engine: each next token is the argmax at a
    mask placed after the clean prefix (the training objective at block size 1)."""
    model = load_model(checkpoint, dtype="float32")
    ids = list(prompt)
    for _ in range(new):
        clean = torch.tensor([[*ids, MASK_ID]])
        masked = torch.zeros_like(clean, dtype=torch.bool)
        masked[0, -1] = True
        noisy = torch.where(masked, torch.full_like(clean, MASK_ID), clean)
        with torch.no_grad():
            token = int(masked_logits(model, clean, noisy, masked, 1).argmax(dim=-1))
        if token in (IM_END, ENDOFTEXT):
            return ids[len(prompt) :], True
        ids.append(token)
    return ids[len(prompt) :], False


def test_the_teacher_text_is_each_prompt_then_its_greedy_continuation(teacher: Path) -> None:
    prompts = [
        DistillPrompt("In the beginning God created the heaven and the earth.", chat=True),
        DistillPrompt("And the earth was without form, and void;", chat=False),
    ]
    stream = teacher_token_stream(teacher, prompts, max_tokens=6, threads=1).tolist()

    tokenizer = load_tokenizer(teacher)
    expected: list[int] = []
    for p in prompts:
        ids = (
            tokenizer.encode_chat([{"role": "user", "content": p.text}], enable_thinking=False)
            if p.chat
            else tokenizer.encode(p.text)
        )
        continuation, ended = greedy_block_one(teacher, ids, 6)
        expected += ids + continuation
        if ended:  # the end a training document of that kind carries
            expected += [IM_END, *tokenizer.encode("\n")] if p.chat else [ENDOFTEXT]
    assert stream == expected
    # Thinking is off, as the demo is served: the chat prompt holds the empty thinking section.
    assert "<think>\n\n</think>" in tokenizer.decode(stream, skip_special_tokens=False)


def test_prompts_come_only_from_the_chapters_given_two_chats_to_one_prose() -> None:
    chapters = [
        Chapter("Genesis", n, tuple(f"verse {n}:{v}" for v in range(1, 21))) for n in range(1, 6)
    ]
    prompts = distill_prompts(chapters, 30, seed=7)
    verses = {v for c in chapters for v in c.verses}
    assert len(prompts) == 30 and len({p.text for p in prompts}) == 30
    assert all(p.text in verses for p in prompts)
    assert sum(p.chat for p in prompts) == 20
    assert distill_prompts(chapters, 30, seed=7) == prompts  # the seed fixes them
    assert distill_prompts(chapters, 30, seed=8) != prompts
    # Asking for more prompts than verses takes every verse once.
    assert len(distill_prompts(chapters, 500, seed=7)) == 100
