"""Incremental detokenization: equal to a full decode at every point, at a cost per step that
does not grow with the length of the output."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.decoding import releasable_text
from engine.detokenizer import IncrementalDetokenizer
from engine.params import SamplingParams
from engine.tokenizer import Tokenizer, load_tokenizer
from tests.engine.conftest import TOKENIZER_VOCAB
from tests.engine.decoding_fixtures import Parts, one_thread, peaked

__all__ = ["one_thread", "peaked"]  # fixtures, imported for pytest

# Multibyte characters of 2, 3 and 4 UTF-8 bytes: the tiny byte-level BPE has no merges for
# them, so they arrive as one token per byte, and a chunk boundary can fall inside one.
TEXTS = ["naïve café", "日本語のテキスト", "emoji 🙂👍🏽 ok", "ελληνικά", "The quick brown fox"]


class CountingTokenizer:
    """The real tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.decoded = 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Path) -> Tokenizer:
    return load_tokenizer(tiny_checkpoint)


def token_sequences(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Pieces of real text (multibyte characters included) mixed with arbitrary ids, special
    ones too: byte tokens that do not form whole characters, in any order."""
    text_pieces = st.sampled_from(TEXTS).map(tok.encode)
    arbitrary = st.lists(st.integers(0, TOKENIZER_VOCAB - 1), min_size=1, max_size=4)
    return st.lists(text_pieces | arbitrary, max_size=12).map(lambda ps: [t for p in ps for t in p])


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_text_equals_a_full_decode_after_every_chunk(tok: Tokenizer, data: st.DataObject) -> None:
    ids = data.draw(token_sequences(tok))
    detok = IncrementalDetokenizer(tok.decode)
    fed = 0
    while fed < len(ids):
        size = data.draw(st.integers(1, 5))
        detok.extend(ids[fed : fed + size])
        fed = min(len(ids), fed + size)
        assert detok.text == tok.decode(ids[:fed])
        assert len(detok) == len(detok.text)
        start = data.draw(st.integers(0, len(detok.text)))
        assert detok.text_from(start) == detok.text[start:]
    assert detok.token_ids == ids


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_streamed_text_is_never_taken_back(tok: Tokenizer, data: st.DataObject) -> None:
    """What releasable_text lets out of the incremental text is a prefix of the final text."""
    ids = data.draw(token_sequences(tok))
    detok = IncrementalDetokenizer(tok.decode)
    sent = ""
    for i in range(0, len(ids), 3):
        detok.extend(ids[i : i + 3])
        sent += releasable_text(detok.text_from(len(sent)), finished=False, stop=["xyz"])
    sent += releasable_text(detok.text_from(len(sent)), finished=True, stop=["xyz"])
    assert sent == tok.decode(ids)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_stop_strings_are_found_across_step_boundaries(tok: Tokenizer, data: st.DataObject) -> None:
    """Fed in steps, the search finds what one search of the whole text finds, and keeps the
    fewest tokens whose text reaches the stop string's end."""
    ids = data.draw(token_sequences(tok))
    full = tok.decode(ids)
    assume(full)
    start = data.draw(st.integers(0, len(full) - 1))
    stop = [full[start : start + data.draw(st.integers(1, 4))], "日本", "zzz"]
    detok = IncrementalDetokenizer(tok.decode)
    hit, known = None, 0
    while hit is None and known < len(ids):
        known = min(len(ids), known + data.draw(st.integers(1, 4)))
        # As the engine does: the tokens of a block in progress are looked at, not fed.
        hit = detok.find_stop(ids[len(detok.token_ids) : known], stop)
        if data.draw(st.booleans()):
            detok.extend(ids[len(detok.token_ids) : known])
    assert hit is not None  # stop[0] is in the text
    text = tok.decode(ids[:known])
    pos, first = min((text.find(s), s) for s in stop if s in text)
    assert hit.text_end == pos
    needed = pos + len(first)
    assert hit.num_tokens == next(
        n for n in range(1, known + 1) if len(tok.decode(ids[:n])) >= needed
    )


def test_decoding_cost_per_chunk_does_not_grow_with_the_length(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting.decode)
    ids = [t for _ in range(60) for text in TEXTS for t in tok.encode(text + " ")]
    per_chunk = []
    for i in range(0, len(ids), 4):
        before = counting.decoded
        detok.extend(ids[i : i + 4])
        detok.find_stop(ids[i + 4 : i + 8], ["never there"])
        per_chunk.append(counting.decoded - before)
    assert detok.text == tok.decode(ids)
    assert len(ids) > 2000
    # A window is the last confirmed chunk plus what is pending (here at most a few chunks of
    # one script's bytes), decoded about three times per chunk; a full decode would be 2000+.
    assert max(per_chunk) <= 64
    assert sum(per_chunk[-100:]) <= sum(per_chunk[:100]) * 1.5


@pytest.fixture
def counting_parts(peaked: Parts) -> Iterator[tuple[Parts, CountingTokenizer]]:
    counting = CountingTokenizer(peaked.tokenizer)
    yield Parts(peaked.model, counting), counting  # type: ignore[arg-type]


@pytest.mark.usefixtures("one_thread")
def test_engine_decodes_a_bounded_number_of_tokens_per_step(
    counting_parts: tuple[Parts, CountingTokenizer],
) -> None:
    """The engine's per-step decode work (stop search and emitted text) is bounded by the
    block, not by how much was generated before."""
    parts, counting = counting_parts
    core = parts.core(max_batch_size=1, max_seq_len=512)
    core.eos_token_ids = frozenset()  # run to max_tokens: a long output
    prompt = parts.tokenizer.encode("The quick brown fox")
    params = SamplingParams(max_tokens=400, steps=2, stop=["never in this output"])
    core.add_request("r", prompt, params)
    per_step, text, tokens = [], "", []
    while core.has_unfinished():
        before = counting.decoded
        for update in core.step():
            text += update.text_delta
            tokens += update.new_token_ids
        per_step.append(counting.decoded - before)
    assert len(tokens) == 400
    assert text == parts.tokenizer.decode(tokens)
    # A few blocks of 4 per step, however long the output; decoding all of it would be up to
    # 400 tokens a step by the end.
    assert max(per_step) <= 64
    assert sum(per_step[-50:]) <= sum(per_step[:50]) * 2
