"""The agent's bounded buffer of log lines waiting to be shipped, and what a line becomes in it.

A line is made safe before it is buffered (`shipped_text`): escape sequences and other control
characters out, secrets redacted (`runtime.logs.redact`, and `key=value` secrets), cut at
`MAX_LINE_CHARS` with a mark saying so; then its request id, if it names one, is read off the
redacted text.

The buffer is bounded by lines and by bytes. When it is full, the NEWEST lines are dropped and
counted, not the oldest:

- the batch in flight (sent, not yet answered) is the head of the buffer; dropping from the
  head would take lines out from under it, and the acknowledgement could no longer say which
  lines left;
- what is kept stays contiguous per instance (the lines up to the moment the buffer filled, the
  control plane down or an engine flooding), with one gap that `LogBatch.dropped` counts;
- a dropped line costs nothing to drop: it is counted before it is decoded or redacted, so a
  flood costs little more than reading it.

The price: in a long outage, the lines that survive are the first ones, not the last.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import ValidationError

from protocol.logs import (
    MAX_BATCH_BYTES,
    MAX_BATCH_LINES,
    MAX_LINE_CHARS,
    REQUEST_ID_PATTERN,
    LogBatch,
    LogSource,
    ShippedLine,
)
from protocol.plain_text import printable
from runtime.logs import REDACTED, redact

CUT_MARK = f" [cut: longer than {MAX_LINE_CHARS} characters]"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
# `"request_id": "abc"` in a JSON line (a regex: parsing every line costs more than the rest).
_JSON_REQUEST_ID = re.compile(r'"request_id"\s*:\s*"(?P<id>[^"\\]{1,128})"')
# `request_id=abc` or `request_id="abc"` in a key=value line (runtime.logs' kv format).
_KV_REQUEST_ID = re.compile(r'(?:^|\s)request_id=("?)(?P<id>[A-Za-z0-9._:\-]{1,128})\1(?=\s|$)')


# `api_key=...`, `"password": "..."`, `Authorization: Basic ...` in free text: what
# `runtime.logs` scrubs from structured fields by name, in lines written by other programs (an
# engine that is not ours, a library's print). Numbers are no secret (`max_tokens=512`).
_SECRET_KEYS = ("token", "secret", "passw", "key", "authorization")
_KEY_VALUE_SECRET = re.compile(
    r"(?i)((?:token|secret|password|passwd|api[_-]?key|authorization)[\"']?\s*[=:]\s*[\"']?)"
    r"(?!\d+(?:\.\d+)?(?:[\s\"',;&}]|$))"
    r"(?:(?:basic|bearer|digest|token)\s+)?[^\s\"',;&}]+"
)


def redact_line(text: str) -> str:
    """TEXT with secrets replaced by `***`: `runtime.logs.redact`, and key=value secrets."""
    text = redact(text)
    lowered = text.lower()  # the regex is slow; most lines name none of its keys
    if any(key in lowered for key in _SECRET_KEYS):
        text = _KEY_VALUE_SECRET.sub(lambda m: m.group(1) + REDACTED, text)
    return text


def shipped_text(raw: str, cut: bool = False) -> str:
    """RAW as it may leave the host: printable, redacted, at most MAX_LINE_CHARS (+ the mark);
    CUT: it was cut already, before it reached here."""
    text = redact_line(printable(raw))
    if len(text) > MAX_LINE_CHARS:
        text, cut = text[:MAX_LINE_CHARS], True
    return text + CUT_MARK if cut else text


def request_id_in(text: str) -> str | None:
    """The `request_id` a JSON or key=value log line names, when it is a valid one."""
    if '"request_id"' in text and text.startswith("{"):
        match = _JSON_REQUEST_ID.search(text)
    elif "request_id=" in text:
        match = _KV_REQUEST_ID.search(text)
    else:
        return None
    found = match.group("id") if match else None
    return found if found is not None and _REQUEST_ID.match(found) else None


def json_size(text: str) -> int:
    """Bytes TEXT takes in a JSON body (UTF-8, `"`, `\\` and tab escaped; `shipped_text` left no
    other control character), so that a batch's bound holds on the wire too."""
    return len(text.encode()) + text.count('"') + text.count("\\") + text.count("\t")


@dataclass(slots=True)
class BufferedLine:
    """A line in the buffer: what `ShippedLine` will carry, its size, and for an engine line the
    file position after it (to resume there after an agent restart)."""

    source: LogSource
    instance_id: int | None
    time: float
    seq: int
    line: str
    request_id: str | None
    size: int
    cursor: tuple[int, int] | None = None


@dataclass(frozen=True)
class Acknowledged:
    """What left the buffer with an acknowledged batch."""

    lines: list[BufferedLine]
    dropped: int


class LogBuffer:
    """Lines waiting to be shipped, oldest first, at most MAX_LINES lines and MAX_BYTES bytes;
    see the module docstring for what happens when it is full."""

    def __init__(self, max_lines: int = 20_000, max_bytes: int = 8 << 20) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self.bytes = 0
        self.dropped_total = 0
        self._lines: deque[BufferedLine] = deque()
        self._seq: dict[int | None, int] = {}
        self._unreported = 0  # dropped since the last acknowledged batch
        self._in_flight: tuple[int, int] | None = None  # (lines, dropped) of the batch sent
        # A line did not fit: none is taken until lines leave (no later, shorter one slips in).
        self._no_room = False

    def __len__(self) -> int:
        return len(self._lines)

    @property
    def full(self) -> bool:
        """No line is taken: the line bound is reached, or a line did not fit the byte bound
        (until lines leave)."""
        return self._no_room or len(self._lines) >= self.max_lines

    def drop(self, count: int = 1) -> None:
        """Count COUNT lines that did not fit (or could not be kept)."""
        self._unreported += count
        self.dropped_total += count

    def add(
        self,
        source: LogSource,
        instance_id: int | None,
        time: float,
        raw: str,
        *,
        cut: bool = False,
        request_id: str | None = None,
        cursor: tuple[int, int] | None = None,
    ) -> bool:
        """Make RAW safe (`shipped_text`) and keep it; False (counted) when it does not fit.
        REQUEST_ID: the one the record carries; else read off the line."""
        if self.full:
            self.drop()
            return False
        text = shipped_text(raw, cut)
        size = json_size(text)
        if self.bytes + size > self.max_bytes:
            self._no_room = True
            self.drop()
            return False
        if request_id is None or not _REQUEST_ID.match(request_id):
            request_id = request_id_in(text)
        seq = self._seq.get(instance_id, 0)
        self._seq[instance_id] = seq + 1
        self._lines.append(
            BufferedLine(source, instance_id, time, seq, text, request_id, size, cursor)
        )
        self.bytes += size
        return True

    def next_batch(self) -> LogBatch | None:
        """The oldest lines that fit one heartbeat, and the drops not yet acknowledged; None when
        there is neither. They stay in the buffer until `acknowledge()`."""
        taken, size, lines = 0, 0, []
        for buffered in self._lines:
            if taken == MAX_BATCH_LINES or (taken and size + buffered.size > MAX_BATCH_BYTES):
                break
            taken += 1
            size += buffered.size
            try:
                lines.append(_shipped(buffered))
            except ValidationError:  # never expected; one bad line must not refuse a heartbeat
                self.drop()
        if not taken and not self._unreported:
            self._in_flight = None
            return None
        self._in_flight = (taken, self._unreported)
        return LogBatch(lines=lines, dropped=self._unreported)

    def acknowledge(self) -> Acknowledged:
        """The batch last taken got through: it leaves the buffer."""
        if self._in_flight is None:
            return Acknowledged([], 0)
        taken, dropped = self._in_flight
        self._in_flight = None
        self._unreported -= dropped
        gone = [self._lines.popleft() for _ in range(taken)]
        self.bytes -= sum(line.size for line in gone)
        self._no_room = self._no_room and not gone
        return Acknowledged(gone, dropped)

    def discard_in_flight(self) -> int:
        """The batch last taken was refused as such (never to be accepted): drop its lines,
        counted, so that they do not block every batch after them. Returns how many."""
        if self._in_flight is None:
            return 0
        taken, _dropped = self._in_flight
        self._in_flight = None
        for _ in range(taken):
            self.bytes -= self._lines.popleft().size
        self._no_room = self._no_room and not taken
        self.drop(taken)
        return taken


def _shipped(line: BufferedLine) -> ShippedLine:
    return ShippedLine(
        source=line.source,
        instance_id=line.instance_id,
        time=datetime.fromtimestamp(line.time, UTC),
        seq=line.seq,
        line=line.line,
        request_id=line.request_id,
    )
