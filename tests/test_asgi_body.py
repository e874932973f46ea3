"""The body limit and disconnect rules every dctl server (gateway, engine, control plane) shares."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from runtime.asgi_body import (
    BodyTooLarge,
    ClientGone,
    Message,
    Receive,
    bounded,
    declared_too_large,
    read_body,
    until_disconnected,
)


def channel(messages: Sequence[Message]) -> tuple[Receive, list[Message]]:
    """A `receive` handing out MESSAGES in order, and the list of those it handed out."""
    pending = list(messages)
    handed: list[Message] = []

    async def receive() -> Message:
        if not pending:
            raise AssertionError("read past the last message")
        handed.append(pending.pop(0))
        return handed[-1]

    return receive, handed


def chunks(*bodies: bytes) -> list[Message]:
    """A body sent in pieces, as a client sending `transfer-encoding: chunked` does."""
    return [
        {"type": "http.request", "body": body, "more_body": i < len(bodies) - 1}
        for i, body in enumerate(bodies)
    ]


def read(messages: Sequence[Message], declared: Any, limit: int) -> bytes:
    receive, _ = channel(messages)
    return asyncio.run(read_body(receive, declared, limit))


def test_a_body_in_pieces_is_read_whole() -> None:
    assert read(chunks(b"ab", b"", b"cd"), None, 4) == b"abcd"
    assert read(chunks(b"abcd"), b"4", 4) == b"abcd"
    assert read([{"type": "http.request"}], None, 4) == b""


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    receive, handed = channel(chunks(b"abcde"))
    with pytest.raises(BodyTooLarge) as refused:
        asyncio.run(read_body(receive, b"5", 4))
    assert refused.value.limit == 4
    assert handed == []


def test_a_body_past_the_limit_is_refused_at_the_piece_that_passes_it() -> None:
    receive, handed = channel(chunks(b"ab", b"cde", b"f" * 100))
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(receive, None, 4))
    assert len(handed) == 2  # the rest is never read


def test_a_lying_or_malformed_length_is_counted_instead() -> None:
    with pytest.raises(BodyTooLarge):
        read(chunks(b"abcde"), b"1", 4)
    assert read(chunks(b"abc"), b"-9", 4) == b"abc"
    assert not declared_too_large("12x", 4)
    assert not declared_too_large(None, 4)
    assert declared_too_large("5", 4)


def test_a_client_that_leaves_mid_body_is_gone() -> None:
    with pytest.raises(ClientGone):
        read([*chunks(b"ab", b"cd")[:1], {"type": "http.disconnect"}], None, 4)


def test_bounded_hands_messages_on_until_the_limit_then_raises_the_callers_error() -> None:
    receive, _ = channel([*chunks(b"ab", b"cd", b"e"), {"type": "http.disconnect"}])
    limited = bounded(receive, 4, lambda: ValueError("too big"))

    seen: list[bytes] = []

    async def drain() -> None:
        while True:
            seen.append((await limited())["body"])

    with pytest.raises(ValueError, match="too big"):
        asyncio.run(drain())
    assert seen == [b"ab", b"cd"]  # the piece that passes the limit is never handed on


def test_until_disconnected_returns_on_the_disconnect_only() -> None:
    receive, handed = channel([*chunks(b"a", b"b"), {"type": "http.disconnect"}])
    asyncio.run(until_disconnected(receive))
    assert [m["type"] for m in handed] == ["http.request", "http.request", "http.disconnect"]
