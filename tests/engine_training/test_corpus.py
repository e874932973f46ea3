"""Reading the `bible` printout the demo model is trained on, and pinning it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.training.corpus import (
    HELD_OUT_EVERY,
    Chapter,
    CorpusError,
    documents,
    load_bible,
    parse_bible,
    split,
)

PRINTOUT = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

1 Kings 2

  1 Now the days of David drew nigh that he should die; and he charged Solomon
his son, saying,
  2 I go the way of all the earth: be thou strong therefore, and shew thyself a
man;

Song of Solomon 1

  1 The song of songs, which is Solomon's.
"""


def test_chapters_verses_and_wrapped_lines_are_read_back() -> None:
    chapters = parse_bible(PRINTOUT)
    assert [(c.book, c.number, len(c.verses)) for c in chapters] == [
        ("Genesis", 1, 2),
        ("1 Kings", 2, 2),
        ("Song of Solomon", 1, 1),
    ]
    assert chapters[0].verses[1] == (
        "And the earth was without form, and void; and darkness was upon the face of the deep. "
        "And the Spirit of God moved upon the face of the waters."
    )
    # The line width of the printout does not matter: rewrapped text parses the same.
    narrow = PRINTOUT.replace("face of\nthe deep", "face\nof the deep")
    assert parse_bible(narrow) == chapters


def test_another_text_is_refused_with_what_to_run(tmp_path: Path) -> None:
    path = tmp_path / "kjv.txt"
    path.write_text(PRINTOUT, encoding="utf-8")
    with pytest.raises(CorpusError, match=r"5 verses .* expected the 31102 verses .*bible gen1:1"):
        load_bible(path)
    with pytest.raises(CorpusError, match="cannot read"):
        load_bible(tmp_path / "missing.txt")


def test_every_fortieth_chapter_is_held_out_and_never_trained_on() -> None:
    chapters = [Chapter("Book", i, (f"verse {i}",)) for i in range(1, 121)]
    train, held = split(chapters)
    assert [c.number for c in held] == [40, 80, 120]
    assert len(train) == 117 and not set(held) & set(train)
    assert HELD_OUT_EVERY == 40


def test_documents_are_prose_or_chat_turns_covering_the_text_in_a_seeded_order() -> None:
    verses = tuple(f"Verse number {i} of the chapter." for i in range(200))
    chapters = [Chapter("Book", 1, verses)]
    docs = documents(chapters, seed=0)
    assert docs == documents(chapters, seed=0) and docs != documents(chapters, seed=1)
    chats = [d for d in docs if d.startswith("<|im_start|>user\n")]
    prose = [d for d in docs if d.endswith("<|endoftext|>")]
    assert chats and prose and len(chats) + len(prose) == len(docs)
    for chat in chats:
        assert chat.endswith("<|im_end|>\n") and "<|im_start|>assistant\n" in chat
    # Every verse appears in some document.
    assert all(any(v in d for d in docs) for v in verses)
