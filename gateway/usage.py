"""The engine's usage report, read off an answer as it streams past to the client.

Token counts come from the engines' own usage reports; the gateway never parses an answer
whole. A JSON answer carries `usage` in its body, and so does a stream's last chunk when the
client asked for `stream_options.include_usage`; our engine also ends every stream with a usage
comment line (`protocol.openai.usage_comment`), asked or not, which `UsageReader` reads and
takes out, so the client gets the engine's events exactly as it would without it. Our engine's
usage of a finished request also says how it was decoded (`usage.dctl`: mean denoising steps
per block, tokens per forward); another engine's answer simply has no such figures.

In an event stream the reader also notes the first event that carries text (`first_token`):
time to first token is measured there, not at the first byte (a chat stream opens with a
role-only chunk at once, before any token exists).
"""

from __future__ import annotations

import re

from protocol.openai import USAGE_COMMENT_PREFIX

# The usage fields read; a key cannot match inside a JSON string (its quotes would be escaped).
_FIELDS_RE = re.compile(
    rb'"(prompt_tokens|completion_tokens|steps_per_block|tokens_per_forward)"\s*:\s*'
    rb"([0-9][0-9.eE+\-]{0,30})"
)
_TEXT_RE = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')  # a non-empty text delta
_TAIL = 64  # bytes kept between chunks so a match split across two is still found
_COMMENT_END = b"\n\n"  # the blank line that ends the comment's event
_MAX_COMMENT_BYTES = 1024  # a usage comment is far shorter: hold back no more than this


class UsageReader:
    """Finds the usage in a response body as it streams past: the last report of each field
    wins (the stream's usage comment, or its usage chunk, comes last).

    With EVENT_STREAM, `feed` also returns the body without the engine's usage comment; bytes
    that may begin one are held back until the next chunk shows whether they do (only ever a
    line starting with `:`, so the engine's `data:` events pass at once).
    """

    def __init__(self, *, event_stream: bool) -> None:
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.steps_per_block: float | None = None
        self.tokens_per_forward: float | None = None
        self.first_token = False  # an event with text went by (event streams only)
        self.event_stream = event_stream
        self._tail = b""  # the end of what was scanned, for a usage field split across chunks
        self._held = b""  # what may be the start of a usage comment
        self._line_start = True  # the next byte forwarded starts a line

    @property
    def tokens(self) -> int:
        """Completion tokens (0 until a usage report said)."""
        return self.completion_tokens or 0

    def feed(self, chunk: bytes) -> bytes:
        """Read the next CHUNK of the body; returns what of it goes on to the client."""
        if self.event_stream:
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
        # Most chunks hold no usage: substring tests are far cheaper than the expressions.
        if b'_tokens"' in data or b"_per_" in data:
            self._read_fields(data)
        if self.event_stream and not self.first_token and _TEXT_RE.search(data):
            self.first_token = True
        self._tail = data[-_TAIL:]

    def _read_fields(self, data: bytes) -> None:
        for match in _FIELDS_RE.finditer(data):
            name, value = match.group(1), match.group(2)
            try:
                if name == b"completion_tokens":
                    self.completion_tokens = int(value)
                elif name == b"prompt_tokens":
                    self.prompt_tokens = int(value)
                elif name == b"steps_per_block":
                    self.steps_per_block = float(value)
                elif name == b"tokens_per_forward":
                    self.tokens_per_forward = float(value)
            except ValueError:  # malformed: the field stays what an earlier report said
                continue

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
        self._read_fields(payload)
