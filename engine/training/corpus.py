"""The training text: the King James Bible as Debian's `bible-kjv` prints it, pinned by digest.

Get it with `apt-get install bible-kjv` (text in `bible-kjv-text`, public domain: the 1611
translation's copyright has long expired) and `bible gen1:1-rev22:21 > kjv.txt`. The printout's
line width depends on the terminal, so what is pinned is the digest of the parsed verses, not of
the file: any width gives the same verses.

Chapters are the documents. Every 40th chapter is held out (never seen in training): it measures
the masked-token loss and gives the quality checks text the model has not memorised.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from pathlib import Path

# sha256 of "\n".join(verse texts) for the 31,102 verses of bible-kjv 4.38.
KJV_VERSES_SHA256 = "9a503270e649168ef3235337e73de9084094a0958ead10c90d4539dfdd81b329"
HELD_OUT_EVERY = 40

_HEADER = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z ]+?) (\d+)$")
_VERSE = re.compile(r"^\s+(\d+) (.*)$")


@dataclass(frozen=True)
class Chapter:
    """One chapter: its book, number and verses (whitespace normalised)."""

    book: str
    number: int
    verses: tuple[str, ...]


class CorpusError(ValueError):
    """The text is not the pinned King James Bible printout."""


def parse_bible(text: str) -> list[Chapter]:
    """Chapters of a `bible` printout: a blank line, "Book N", then "  V text" verses whose
    long lines continue unindented."""
    chapters: list[Chapter] = []
    book, number, verses = "", 0, list[str]()
    previous_blank = True
    for line in text.splitlines():
        header = _HEADER.match(line) if previous_blank else None
        verse = _VERSE.match(line)
        if header:
            if verses:
                chapters.append(Chapter(book, number, tuple(verses)))
            book, number, verses = header.group(1), int(header.group(2)), []
        elif verse and book:
            verses.append(verse.group(2).strip())
        elif line.strip() and verses:
            verses[-1] = f"{verses[-1]} {line.strip()}"
        previous_blank = not line.strip()
    if verses:
        chapters.append(Chapter(book, number, tuple(verses)))
    return [
        Chapter(c.book, c.number, tuple(" ".join(v.split()) for v in c.verses)) for c in chapters
    ]


def verses_digest(chapters: list[Chapter]) -> str:
    """sha256 of every verse's text, one per line, in order."""
    return hashlib.sha256("\n".join(v for c in chapters for v in c.verses).encode()).hexdigest()


def load_bible(path: Path) -> list[Chapter]:
    """The pinned chapters from a `bible` printout; CorpusError names what differs."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CorpusError(f"{path}: cannot read it ({exc})") from exc
    chapters = parse_bible(text)
    digest = verses_digest(chapters)
    if digest != KJV_VERSES_SHA256:
        count = sum(len(c.verses) for c in chapters)
        raise CorpusError(
            f"{path}: {count} verses with digest {digest[:16]}..., expected the 31102 verses of "
            f"bible-kjv 4.38 ({KJV_VERSES_SHA256[:16]}...); make it with "
            "`bible gen1:1-rev22:21 > kjv.txt`"
        )
    return chapters


def split(chapters: list[Chapter]) -> tuple[list[Chapter], list[Chapter]]:
    """(training chapters, held-out chapters): every HELD_OUT_EVERY-th chapter is held out."""
    train = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held


def documents(chapters: list[Chapter], seed: int) -> list[str]:
    """Training documents, in a shuffled order fixed by `seed`.

    Half are prose (a run of 3-10 verses, then <|endoftext|>), half are chat turns in the
    Qwen3 template: a verse as the user's message, the next 1-3 verses as the answer, with the
    empty thinking section half the time. So the model continues text and answers chats.
    """
    rng = random.Random(seed)
    docs: list[str] = []
    for chapter in chapters:
        verses = chapter.verses
        i = 0
        while i < len(verses):
            if rng.random() < 0.5:
                n = rng.randint(3, 10)
                docs.append(" ".join(verses[i : i + n]) + "<|endoftext|>")
                i += n
            else:
                n = rng.randint(1, 3)
                answer = " ".join(verses[i + 1 : i + 1 + n]) or verses[i]
                think = "<think>\n\n</think>\n\n" if rng.random() < 0.5 else ""
                docs.append(
                    f"<|im_start|>user\n{verses[i]}<|im_end|>\n"
                    f"<|im_start|>assistant\n{think}{answer}<|im_end|>\n"
                )
                i += 1 + n
    rng.shuffle(docs)
    return docs
