"""Output tokens read off answers as they stream past, and the engine's usage comment taken out
of what the client gets, however the body is cut into chunks."""

from __future__ import annotations

import random

import pytest

from gateway.usage import UsageReader
from protocol.openai import Usage, usage_comment

EVENTS = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\n'
COMMENT = usage_comment(Usage(prompt_tokens=3, completion_tokens=11, total_tokens=14)).encode()
DONE = b"data: [DONE]\n\n"


def read(chunks: list[bytes], *, event_stream: bool = True) -> tuple[bytes, int]:
    """What the client gets of CHUNKS, and the tokens counted."""
    reader = UsageReader(event_stream=event_stream)
    out = b"".join(reader.feed(chunk) for chunk in chunks) + reader.end()
    return out, reader.tokens


@pytest.mark.parametrize(
    ("chunks", "tokens"),
    [
        ([b'{"usage": {"prompt_tokens": 3, "completion_tokens": 17}}'], 17),
        ([b'{"usage": {"completion_tok', b'ens": 12', b"3}}"], 123),  # split across chunks
        ([b'data: {"choices": [{"text": "\\"completion_tokens\\": 99"}]}\n\n'], 0),  # in a string
        (
            [
                b'data: {"choices": []}\n\n',
                b'data: {"usage": {"completion_tokens": 5}}\n\n',
                b"data: [DONE]\n\n",
            ],
            5,
        ),
    ],
)
def test_output_tokens_come_from_the_usage_report(chunks: list[bytes], tokens: int) -> None:
    out, counted = read(chunks, event_stream=False)
    assert counted == tokens
    assert out == b"".join(chunks)  # a JSON body passes untouched


def test_the_usage_comment_counts_and_is_taken_out_wherever_the_chunks_are_cut() -> None:
    body = EVENTS + COMMENT + DONE
    rng = random.Random(7)
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(0, 6)))
        chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        assert read(chunks) == (EVENTS + DONE, 11), chunks


def test_events_pass_at_once_and_only_a_possible_comment_waits() -> None:
    reader = UsageReader(event_stream=True)
    assert reader.feed(EVENTS) == EVENTS
    assert reader.feed(b"data: {") == b"data: {"  # a data line is never held back
    assert reader.feed(b'"x": 1}\n\n: us') == b'"x": 1}\n\n'
    assert reader.feed(COMMENT[4:] + DONE) == DONE
    assert reader.tokens == 11


def test_the_usage_chunk_the_client_asked_for_stays() -> None:
    chunk = b'data: {"choices": [], "usage": {"completion_tokens": 11}}\n\n'
    assert read([EVENTS, chunk, COMMENT, DONE]) == (EVENTS + chunk + DONE, 11)


def test_other_comments_and_text_that_merely_looks_like_one_pass_untouched() -> None:
    body = b": keep-alive\n\n" + b'data: {"text": ": usage {}"}\n\n' + DONE
    assert read([body]) == (body, 0)
    unfinished = EVENTS + b": usage " + b"x" * 5000  # no end in sight: not a usage comment
    assert read([unfinished[:100], unfinished[100:]]) == (unfinished, 0)
