"""The engine's usage report, read off an answer as it streams past to the client.

Output tokens come from the engines' own usage reports; the gateway never parses an answer
whole. A JSON answer carries `usage` in its body, and so does a stream's last chunk when the
client asked for `stream_options.include_usage`; our engine also ends every stream with a usage
comment line (`protocol.openai.usage_comment`), asked or not, which `UsageReader` reads and
takes out, so the client gets the engine's events exactly as it would without it.
"""

from __future__ import annotations

import contextlib
import re

from protocol.openai import USAGE_COMMENT_PREFIX, Usage

# A usage field; cannot match inside a JSON string (its quotes would be escaped).
_USAGE_KEY = b'"completion_tokens"'
_USAGE_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_USAGE_TAIL = 48  # bytes kept between chunks so a match split across two is still found
_COMMENT_END = b"\n\n"  # the blank line that ends the comment's event
_MAX_COMMENT_BYTES = 1024  # a usage comment is far shorter: hold back no more than this


class UsageReader:
    """Finds the output tokens in a response body as it streams past: the last report wins
    (the stream's usage comment, or its usage chunk, comes last).

    With EVENT_STREAM, `feed` also returns the body without the engine's usage comment; bytes
    that may begin one are held back until the next chunk shows whether they do (only ever a
    line starting with `:`, so the engine's `data:` events pass at once).
    """

    def __init__(self, *, event_stream: bool) -> None:
        self.tokens = 0
        self._event_stream = event_stream
        self._tail = b""  # the end of what was scanned, for a usage field split across chunks
        self._held = b""  # what may be the start of a usage comment
        self._line_start = True  # the next byte forwarded starts a line

    def feed(self, chunk: bytes) -> bytes:
        """Read the next CHUNK of the body; returns what of it goes on to the client."""
        if self._event_stream:
            chunk = self._without_comments(self._held + chunk if self._held else chunk)
        self._scan(chunk)
        return chunk

    def end(self) -> bytes:
        """The body ended: what was held back goes on (it was no usage comment after all)."""
        held, self._held = self._held, b""
        self._scan(held)
        return held

    def _scan(self, data: bytes) -> None:
        if not data:
            return
        data = self._tail + data if self._tail else data
        if _USAGE_KEY in data:  # most chunks hold none: a substring test is far cheaper
            last = None
            for last in _USAGE_RE.finditer(data):  # noqa: B007 - the last match is the one wanted
                pass
            if last is not None:
                self.tokens = int(last.group(1))
        self._tail = data[-_USAGE_TAIL:]

    def _without_comments(self, data: bytes) -> bytes:
        self._held = b""
        kept: list[bytes] = []
        pos = 0
        while (start := self._comment_at(data, pos)) >= 0:
            end = data.find(_COMMENT_END, start)
            if end < 0:
                if len(data) - start <= _MAX_COMMENT_BYTES:  # it goes on in the next chunk
                    self._held = data[start:]
                    data = data[:start]
                break  # else far too long for a usage comment: it is someone else's, passed on
            self._read_comment(data[start + len(USAGE_COMMENT_PREFIX) : end])
            kept.append(data[pos:start])
            pos = end + len(_COMMENT_END)
        rest = data[pos:]
        if not self._held:
            # A line that begins like the comment and is cut short by the chunk's end: wait.
            line = rest.rfind(b"\n") + 1
            starts_line = line > 0 or pos > 0 or self._line_start  # pos > 0: after a comment
            if starts_line and USAGE_COMMENT_PREFIX.startswith(rest[line:]):
                self._held, rest = rest[line:], rest[:line]
        kept.append(rest)
        out = b"".join(kept) if len(kept) > 1 else kept[0]
        if out:
            self._line_start = out.endswith(b"\n")
        return out

    def _comment_at(self, data: bytes, pos: int) -> int:
        """Where the next usage comment starting a line begins in DATA from POS, or -1."""
        while (start := data.find(USAGE_COMMENT_PREFIX, pos)) >= 0:
            if data[start - 1 : start] == b"\n" if start else self._line_start:
                return start
            pos = start + 1
        return -1

    def _read_comment(self, payload: bytes) -> None:
        with contextlib.suppress(ValueError):  # malformed: the count stays what the body said
            self.tokens = Usage.model_validate_json(payload).completion_tokens
