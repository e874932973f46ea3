"""Following one engine log file across the supervisor's rotations, a bounded read at a time.

The supervisor rotates an engine's log two ways (`agent.engine_process`):

- by rename at each (re)start: `instance-N.log` becomes `.1` and the new engine writes a new
  file. The tail holds the old file open, so it reads it to its end before it turns to the new
  one (nothing written before the restart is missed);
- by copy-truncate while the engine runs: the file is copied to `.1` and truncated to 0 (the
  engine keeps appending to the same inode). The tail notices because the file is shorter than
  it was, or its first bytes or those just before the offset changed (truncated, then written
  past the old offset already). It then finds the copy that holds what it read (`.1`, or `.2`
  when it fell further behind: the same first bytes and bytes before the offset), reads that
  from the offset, the newer copies whole, and the live file again from 0. When no copy is left
  that holds it, it counts a gap rather than guessing.

Each `read(budget)` reads at most BUDGET bytes, whatever the engine writes: a flood costs one
bounded read per round, and what is not read yet stays on disk. A line longer than the limit is
cut there (`TailLine.cut`); the rest of it, up to its newline, is skipped.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# What is compared to tell a truncated-and-rewritten file from the one the tail was reading.
_FINGERPRINT = 64
_CHUNK = 64 * 1024
# Rotated files still to be read beyond this many: the oldest is given up (a gap).
_MAX_BACKLOG = 4


class TailLine(NamedTuple):
    """One line as read: its bytes (no newline), whether it was cut, and where it ended (the
    file's inode and the offset after its newline: a cursor to resume after it)."""

    data: bytes
    cut: bool
    inode: int
    end: int


class Cursor(NamedTuple):
    """Where a tail stands in a file: (inode, offset)."""

    inode: int
    offset: int


@dataclass
class _Source:
    """One open file being read: the live one, or a rotated one to be read to its end."""

    fd: int
    inode: int
    offset: int
    partial: bytearray = field(default_factory=bytearray)
    skipping: bool = False  # inside a line already cut: skip to its newline
    fingerprint: bytes = b""  # the bytes just before `offset`, as read
    head: bytes = b""  # the file's first bytes, as first seen
    seen_size: int = 0  # the largest size seen

    def bytes_at(self, start: int, count: int) -> bytes:
        """COUNT bytes from START (fewer at the end of the file)."""
        try:
            return os.pread(self.fd, count, start) if count > 0 else b""
        except OSError:
            return b""

    def fingerprint_at(self, offset: int) -> bytes:
        """The bytes just before OFFSET in this file (empty at 0)."""
        start = max(offset - _FINGERPRINT, 0)
        return self.bytes_at(start, offset - start)

    def holds_what_was_read(self, reader: _Source) -> bool:
        """Whether this file starts as READER's did and holds what it read up to its offset
        (the same file, or a copy of it)."""
        return (
            self.bytes_at(0, len(reader.head)) == reader.head
            and self.fingerprint_at(reader.offset) == reader.fingerprint
        )

    def observe(self) -> None:
        """Remember the size and the first bytes of the file as it is now."""
        try:
            self.seen_size = max(self.seen_size, os.fstat(self.fd).st_size)
        except OSError:
            return
        if len(self.head) < _FINGERPRINT:
            self.head = self.bytes_at(0, _FINGERPRINT)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class FileTail:
    """Follows the log file at PATH; see the module docstring.

    START resumes after a cursor saved earlier (an agent restart): in the live file when its
    inode matches, else in `.1` when that is the file (rotated meanwhile). Without one, or when
    neither matches, the live file is read from its start.
    """

    def __init__(self, path: Path, max_line_bytes: int, start: Cursor | None = None) -> None:
        self.path = path
        self.max_line_bytes = max_line_bytes
        self.gaps = 0  # times bytes were rotated away before they were read
        self.bytes_read = 0
        self._live: _Source | None = None
        self._backlog: list[_Source] = []
        self._start = start

    # --- reading --------------------------------------------------------------------------------

    def read(self, budget: int) -> list[TailLine]:
        """The complete lines of the next BUDGET bytes at most (rotated files first)."""
        self._follow()
        lines: list[TailLine] = []
        while budget > 0:
            source = self._backlog[0] if self._backlog else self._live
            if source is None:
                break
            try:
                chunk = os.pread(source.fd, min(budget, _CHUNK), source.offset)
            except OSError:
                chunk = b""
            if not chunk:
                if source is self._live:
                    break
                self._finish(source, lines)
                continue
            budget -= len(chunk)
            self.bytes_read += len(chunk)
            self._split(source, chunk, lines)
        return lines

    def at_end(self) -> bool:
        """Nothing left to read: no rotated file pending and the live file read to its end."""
        self._follow()
        if self._backlog:
            return False
        if self._live is None:
            return True
        try:
            return os.fstat(self._live.fd).st_size <= self._live.offset
        except OSError:
            return True

    def close(self) -> None:
        """Close every file held."""
        for source in [*self._backlog, *([self._live] if self._live else [])]:
            source.close()
        self._backlog, self._live = [], None

    # --- rotation -----------------------------------------------------------------------------

    def _follow(self) -> None:
        """Notice a rename or a copy-truncate of the live file, or a new one to open."""
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        live = self._live
        if live is not None and (st is None or st.st_ino != live.inode):
            # Renamed away (the engine restarts): what is left of it comes first.
            self._queue(live)
            self._live = live = None
        if live is None:
            if st is not None:
                self._open_live()
            return
        try:
            size = os.fstat(live.fd).st_size
        except OSError:
            return
        # Shorter than it was, or not what was read (truncated, then written past that point).
        if size < live.seen_size or not live.holds_what_was_read(live):
            self._truncated(live)
        live.observe()

    def _open_live(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        st = os.fstat(fd)
        live = self._live = _Source(fd, st.st_ino, 0)
        start, self._start = self._start, None
        if start is not None and start.inode == st.st_ino and start.offset <= st.st_size:
            live.offset = start.offset
            live.fingerprint = live.fingerprint_at(live.offset)
        elif start is not None:
            rotated = self._open_rotated(start)
            if rotated is not None:
                self._queue(rotated)
        live.observe()

    def _open_rotated(self, at: Cursor) -> _Source | None:
        """`.1` opened at AT when it is the file AT points into, else None."""
        try:
            fd = os.open(self.path.with_name(self.path.name + ".1"), os.O_RDONLY)
        except OSError:
            return None
        st = os.fstat(fd)
        if st.st_ino != at.inode or st.st_size < at.offset:
            os.close(fd)
            return None
        return _Source(fd, st.st_ino, at.offset)

    def _truncated(self, live: _Source) -> None:
        """The live file was copy-truncated: read its rest from the copy, and the copies made
        since, when they are still there."""
        copies = self._copies_since(live)
        if copies:
            copies[0].partial, copies[0].skipping = live.partial, live.skipping
            for copy in copies:
                self._queue(copy)
        elif live.offset > 0 or live.seen_size > 0:
            self.gaps += 1
        live.offset, live.partial, live.skipping = 0, bytearray(), False
        live.fingerprint, live.head, live.seen_size = b"", b"", 0

    def _copies_since(self, live: _Source) -> list[_Source]:
        """The rotated copy holding what LIVE had read (at LIVE's offset), then every newer one
        (from their start), oldest first; none when no copy holds it."""
        opened: list[_Source] = []
        for n in range(1, _MAX_BACKLOG + 1):
            try:
                fd = os.open(self.path.with_name(f"{self.path.name}.{n}"), os.O_RDONLY)
            except OSError:
                break
            copy = _Source(fd, os.fstat(fd).st_ino, 0)
            opened.append(copy)
            if copy.inode != live.inode and copy.holds_what_was_read(live):
                copy.offset = live.offset
                return opened[::-1]
        for copy in opened:
            copy.close()
        return []

    def _queue(self, source: _Source) -> None:
        self._backlog.append(source)
        while len(self._backlog) > _MAX_BACKLOG:
            self._backlog.pop(0).close()
            self.gaps += 1

    def _finish(self, source: _Source, lines: list[TailLine]) -> None:
        """A rotated file read to its end: its unterminated last line counts as a line."""
        if source.partial and not source.skipping:
            lines.append(TailLine(bytes(source.partial), False, source.inode, source.offset))
        source.close()
        self._backlog.remove(source)

    # --- lines --------------------------------------------------------------------------------

    def _split(self, source: _Source, chunk: bytes, lines: list[TailLine]) -> None:
        *whole, rest = chunk.split(b"\n")
        end = source.offset
        source.offset += len(chunk)
        limit, inode = self.max_line_bytes, source.inode
        for part in whole:
            end += len(part) + 1
            if source.skipping:  # the end of a line already cut
                source.skipping = False
                continue
            if source.partial:
                source.partial += part
                part, source.partial = bytes(source.partial), bytearray()
            if part.endswith(b"\r"):
                part = part[:-1]
            if len(part) > limit:
                lines.append(TailLine(part[:limit], True, inode, end))
            else:
                lines.append(TailLine(part, False, inode, end))
        if not source.skipping:
            source.partial += rest
            if len(source.partial) > limit:
                lines.append(TailLine(bytes(source.partial[:limit]), True, inode, source.offset))
                source.partial, source.skipping = bytearray(), True
        tail = chunk[-_FINGERPRINT:]
        if len(tail) < _FINGERPRINT:
            tail = (source.fingerprint + tail)[-_FINGERPRINT:]
        source.fingerprint = tail
