"""Incremental detokenization: a request's text grows by decoding a short window per step.

Decoding the whole generated sequence at every step costs O(length) per step, O(length²) per
request. Instead (the prefix-offset / read-offset scheme of Hugging Face TGI and vLLM) the text
is kept in two parts:
- the *confirmed* text, decode(ids[:read]), final and never decoded again;
- the *tail*, the text the tokens from `read` on add to it, read off a decode of the window
  ids[prefix:] minus the text of its context ids[prefix:read].
Byte-level BPE pieces need not end on a character boundary: while the window's text ends in
U+FFFD (a partial UTF-8 character, which the next token may complete) the tail stays
tentative; once it does not, it is confirmed and the window restarts at the tokens just
confirmed (kept as context, so decoders that treat a leading space specially see the same
neighbours). The confirmed text plus the tail always equals a full decode of the ids: UTF-8 is
self-synchronising, so bytes that end on a whole character decode the same alone as in front
of anything else.

Stop strings are searched in the same spirit: each search looks only at text that is new since
the last one, plus the last len(longest stop) - 1 characters before it, so an occurrence that
straddles two steps is still found.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what a decode shows for bytes that are not (yet) a whole character


@dataclass(frozen=True)
class StopHit:
    """The earliest stop string in a request's text, and the tokens that produce it."""

    num_tokens: int  # tokens kept: up to the first one whose text reaches the stop's end
    text_end: int  # the text is cut here, where the stop string starts


class IncrementalDetokenizer:
    """The text of a growing token sequence, decoding only a bounded window per call."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # the window starts here: ids[prefix:read] is its context
        self._read = 0  # ids[:read] are confirmed
        self._context_text = ""  # decode(ids[prefix:read])
        self._confirmed = ""  # decode(ids[:read])
        self._tail = ""  # what ids[read:] add to the confirmed text (may end in U+FFFD)
        # Where the last stop search left off: the text before `searched` holds no stop string
        # and will not change; (prefix, read, context, confirmed) as they were then.
        self._mark = _SearchMark(0, 0, 0, "", 0)

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed so far (do not modify)."""
        return self._ids

    def __len__(self) -> int:
        """Characters of the text so far."""
        return len(self._confirmed) + len(self._tail)

    @property
    def text(self) -> str:
        """The whole text so far: equal to a full decode of `token_ids`."""
        return self._confirmed + self._tail

    def text_from(self, start: int) -> str:
        """text[start:], built without copying the part before `start`."""
        if start >= len(self._confirmed):
            return self._tail[start - len(self._confirmed) :]
        return self._confirmed[start:] + self._tail

    def extend(self, ids: Sequence[int]) -> None:
        """Append tokens; confirm the window's text unless it ends in a partial character."""
        if not ids:
            return
        self._ids.extend(ids)
        window = self._window_text(())
        if len(window) > len(self._context_text) and not window.endswith(REPLACEMENT):
            self._confirmed += window[len(self._context_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            self._context_text = self._decode(self._ids[self._prefix : self._read])
            self._tail = ""
        else:
            self._tail = window[len(self._context_text) :]

    def find_stop(
        self, extra: Sequence[int], stop: Sequence[str], min_tokens: int = 0
    ) -> StopHit | None:
        """The earliest stop string in the text of token_ids + extra (extra is not kept).

        `extra` are tokens known to be final but not fed yet (a block's unmasked prefix). Only
        text not searched by an earlier call is looked at, so calls must see a sequence that
        only grows. The hit keeps the fewest tokens whose text reaches the stop string's end;
        one that ends within the first `min_tokens` tokens does not count (vLLM's rule).
        """
        tail = self._window_text(extra)[len(self._context_text) :]
        longest = max(len(s) for s in stop)
        start = max(0, self._mark.searched - longest + 1)
        if start >= len(self._confirmed):
            region = tail[start - len(self._confirmed) :]
        else:
            region = self._confirmed[start:] + tail
        hits = sorted(
            (pos, s) for s in stop for pos in _occurrences(region, s, every=min_tokens > 0)
        )
        if not hits:
            # A trailing U+FFFD may still become another character: search it again next time.
            searched = len(self._confirmed) + len(tail.rstrip(REPLACEMENT))
            self._mark = _SearchMark(
                searched, self._prefix, self._read, self._context_text, len(self._confirmed)
            )
            return None
        for pos, hit in hits:
            tokens = self._tokens_reaching(start + pos + len(hit), extra)
            if tokens >= min_tokens:
                return StopHit(tokens, start + pos)
        # Every hit ends before min_tokens: the search mark stays, so that the next call's
        # `_tokens_reaching` still measures from text that held no stop string.
        return None

    def _window_text(self, extra: Sequence[int]) -> str:
        return self._decode(self._ids[self._prefix :] + list(extra))

    def _tokens_reaching(self, chars: int, extra: Sequence[int]) -> int:
        """Fewest tokens of token_ids + extra whose text is at least `chars` long.

        The stop string was not in the text searched last time, so it ends past the text that
        was confirmed then: the answer lies past that `read`, where one decode per token of
        the window as it was then measures the text (the length of a decode never shrinks as
        tokens are added).
        """
        mark = self._mark
        context = self._ids[mark.prefix : mark.read]
        pending = self._ids[mark.read :] + list(extra)
        for count in range(1, len(pending) + 1):
            text = self._decode(context + pending[:count])
            if mark.confirmed + len(text) - len(mark.context_text) >= chars:
                return mark.read + count
        return mark.read + len(pending)


def _occurrences(text: str, stop: str, *, every: bool) -> list[int]:
    """Where STOP starts in TEXT: the first place only, or EVERY place (overlaps included)."""
    found: list[int] = []
    pos = text.find(stop)
    while pos >= 0:
        found.append(pos)
        if not every:
            break
        pos = text.find(stop, pos + 1)
    return found


@dataclass(frozen=True)
class _SearchMark:
    searched: int
    prefix: int
    read: int
    context_text: str
    confirmed: int
