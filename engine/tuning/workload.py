"""What a sweep decodes: the chat prompts and the held-out passages, read from text files."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The demo checkpoint's own prompt set: the default when neither --prompts nor a prompts.txt
# in the checkpoint directory says otherwise.
DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "demo_model" / "prompts.txt"
PROMPTS_FILE = "prompts.txt"
HELDOUT_FILE = "heldout.txt"
HELDOUT_PROMPT_TOKENS = 48


class WorkloadError(ValueError):
    """A prompts or held-out file that cannot be used; the message names the file."""


def read_prompts(path: Path) -> list[str]:
    """User messages, one per line; blank lines are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise WorkloadError(f"prompts file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"prompts file {path} cannot be read: {exc}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise WorkloadError(f"prompts file {path} is empty; write one user message per line")
    return prompts


def default_prompts_file(model_dir: Path | None) -> Path | None:
    """The prompts a sweep uses without --prompts: the checkpoint's, else the demo model's."""
    for candidate in ([model_dir / PROMPTS_FILE] if model_dir else []) + [DEMO_PROMPTS]:
        if candidate.is_file():
            return candidate
    return None


def read_paragraphs(path: Path) -> list[str]:
    """Paragraphs of a text file (separated by blank lines), each joined into one line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"held-out file {path} cannot be read: {exc}") from None
    paragraphs, current = [], []
    for line in [*text.splitlines(), ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return paragraphs


@dataclass(frozen=True)
class HeldoutPassage:
    """A prompt of token ids and the true tokens that follow it."""

    prompt: list[int]
    continuation: list[int]


def heldout_passages(
    paragraphs: Sequence[str],
    encode: Callable[[str], list[int]],
    *,
    count: int,
    continuation: int,
    prompt_tokens: int = HELDOUT_PROMPT_TOKENS,
) -> list[HeldoutPassage]:
    """`count` passages spread evenly over the paragraphs long enough for a prompt of
    `prompt_tokens` plus `continuation` true tokens (the largest block size of the sweep).

    The choice depends on the file alone, so every setting and every run sees the same ones.
    """
    need = prompt_tokens + continuation
    usable = [ids for ids in map(encode, paragraphs) if len(ids) >= need]
    if count <= 0 or not usable:
        return []
    picks = sorted({i * len(usable) // count for i in range(min(count, len(usable)))})
    return [HeldoutPassage(usable[i][:prompt_tokens], usable[i][prompt_tokens:need]) for i in picks]
