"""Engine and agent log lines, shipped to the control plane in heartbeats (`Heartbeat.logs`).

    instance-N.log --FileTail, a bounded read per round--\\
                                                          +--> LogBuffer (bounded, made safe)
    the agent's own records --AgentLogHandler (pending)--/
    LogBuffer --next_batch()--> Heartbeat.logs --200--> acknowledge(): the batch leaves

The loop calls `collect()` every round and, at each heartbeat, `next_batch()` then
`acknowledge()` once the heartbeat got through. A heartbeat that fails leaves the batch where
it is: the next one sends it again, with whatever came after it, in order. An instance that is
gone is followed until its file is read to its end.

Where each file was read up to is saved when the lines before it are acknowledged (the cursor
file), so an agent restart neither ships an adopted engine's log again nor skips what the engine
wrote while the agent was down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import NamedTuple

from agent.log_buffer import Acknowledged, LogBuffer
from agent.log_tail import Cursor, FileTail
from agent.private_files import write_private
from protocol.logs import MAX_LINE_CHARS, LogBatch

log = logging.getLogger("dctl.agent.logs")

# Bytes read from engine logs per round (all files together; the rest waits on disk): 2 MiB/s at
# the loop's 4 rounds a second, ~25 ms of a round when every line is kept (~5 us a line made
# safe). With the buffer full, lines are only counted, 8 times as many bytes in the same time:
# the tail keeps up with a flood instead of losing it to rotation uncounted.
READ_BYTES_PER_ROUND = 512 * 1024
SKIM_FACTOR = 8
# Each file's share of a round's bytes is at least this (many instances on one host).
_MIN_SHARE = 64 * 1024
# A line's bytes are cut here before decoding (UTF-8 takes at most 4 bytes a character).
MAX_LINE_BYTES = 4 * MAX_LINE_CHARS
GAP_LINE = "[dctl agent: part of this log was rotated away before it was read]"


class _Record(NamedTuple):
    time: float
    line: str
    request_id: str | None


class AgentLogHandler(logging.Handler):
    """Hands the agent's own log records to the shipper, formatted by the project's formatter
    (which redacts; the buffer redacts again), through a pending list the loop drains.

    It never blocks on I/O and never logs: `emit` holds a lock only to append a line or count a
    drop (at most CAPACITY lines wait), and a record logged while one is being formatted on the
    same thread (an argument whose `__str__` logs) is not handled again.
    """

    def __init__(self, capacity: int = 1000) -> None:
        super().__init__()
        self.capacity = capacity
        self._pending: list[_Record] = []
        self._dropped = 0
        self._pending_lock = threading.Lock()
        self._inside = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        """Format RECORD and put it in the pending list (or count it when that is full)."""
        if getattr(self._inside, "active", False):
            return
        self._inside.active = True
        try:
            if len(self._pending) >= self.capacity:
                line = None  # not worth formatting: it cannot be kept
            else:
                line = self.format(record)[: MAX_LINE_BYTES + 1]
            request_id = getattr(record, "request_id", None)
            with self._pending_lock:
                if line is None or len(self._pending) >= self.capacity:
                    self._dropped += 1
                else:
                    rid = request_id if isinstance(request_id, str) else None
                    self._pending.append(_Record(record.created, line, rid))
        except Exception:  # a handler must not raise into the code that logged
            with self._pending_lock:
                self._dropped += 1
        finally:
            self._inside.active = False

    def drain(self) -> tuple[list[_Record], int]:
        """The records waiting, oldest first, and how many did not fit since the last drain."""
        with self._pending_lock:
            records, self._pending = self._pending, []
            dropped, self._dropped = self._dropped, 0
        return records, dropped


class LogShipper:
    """Follows the log files of a supervisor's instances and the agent's own records into one
    bounded buffer, and hands it out a heartbeat's batch at a time; see the module docstring.

    LOG_PATH: an instance's log file (`Supervisor.log_path`). CURSOR_FILE: where read positions
    are kept across agent restarts (None: not kept).
    """

    def __init__(
        self,
        log_path: Callable[[int], Path],
        buffer: LogBuffer | None = None,
        *,
        cursor_file: Path | None = None,
        read_bytes_per_round: int = READ_BYTES_PER_ROUND,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log_path = log_path
        self.buffer = buffer if buffer is not None else LogBuffer()
        self.cursor_file = cursor_file
        self.read_bytes_per_round = read_bytes_per_round
        self.clock = clock
        self.handler = AgentLogHandler()
        self.round_bytes = 0  # bytes of engine logs the last round read
        self._tails: dict[int, FileTail] = {}
        self._cursors = {
            i: c for i, c in _load_cursors(cursor_file).items() if _log_exists(log_path(i))
        }
        self._forgotten: set[int] = set()  # instances gone and read to the end: cursors go

    def collect(self, instance_ids: Collection[int]) -> None:
        """One round: read the next bounded bytes of each instance's log (and the rest of those
        of instances gone), and the agent's own records, into the buffer."""
        instance_ids = set(instance_ids)
        for instance_id in instance_ids:
            if instance_id not in self._tails:
                start = self._cursors.get(instance_id)
                path = self.log_path(instance_id)
                self._tails[instance_id] = FileTail(path, MAX_LINE_BYTES, start)
                self._forgotten.discard(instance_id)
        buffer = self.buffer
        budget = self.read_bytes_per_round * (SKIM_FACTOR if buffer.full else 1)
        share = max(budget // max(len(self._tails), 1), _MIN_SHARE)
        now = self.clock()
        self.round_bytes = 0
        for instance_id, tail in list(self._tails.items()):
            gaps, read_before = tail.gaps, tail.bytes_read
            lines = tail.read(share)
            self.round_bytes += tail.bytes_read - read_before
            if tail.gaps > gaps:
                buffer.add("engine", instance_id, now, GAP_LINE)
            for n, line in enumerate(lines):
                if buffer.full:
                    buffer.drop(len(lines) - n)  # counted, never decoded nor redacted
                    break
                text = line.data.decode(errors="replace")
                cursor = (line.inode, line.end)
                buffer.add("engine", instance_id, now, text, cut=line.cut, cursor=cursor)
            if instance_id not in instance_ids and tail.at_end():
                tail.close()
                del self._tails[instance_id]
                self._forgotten.add(instance_id)
        records, dropped = self.handler.drain()
        buffer.drop(dropped)
        for record in records:
            buffer.add("agent", None, record.time, record.line, request_id=record.request_id)

    def next_batch(self) -> LogBatch | None:
        """The next heartbeat's `LogBatch` (None: nothing to ship); see `LogBuffer.next_batch`."""
        return self.buffer.next_batch()

    def acknowledge(self) -> Acknowledged:
        """The heartbeat that carried the last batch got a 200: it leaves the buffer, and the
        files' read positions move past it."""
        acked = self.buffer.acknowledge()
        moved = False
        for line in acked.lines:
            if line.cursor is not None and line.instance_id in self._tails:
                self._cursors[line.instance_id] = Cursor(*line.cursor)
                moved = True
        stale = self._forgotten & self._cursors.keys()
        for instance_id in stale:
            del self._cursors[instance_id]
        self._forgotten.clear()
        if moved or stale:
            self._save_cursors()
        return acked

    def discard_in_flight(self) -> int:
        """The control plane refused the batch itself: drop it (counted) so the next goes."""
        return self.buffer.discard_in_flight()

    def close(self) -> None:
        """Close every log file held."""
        for tail in self._tails.values():
            tail.close()
        self._tails.clear()

    def _save_cursors(self) -> None:
        if self.cursor_file is None:
            return
        saved = {str(i): list(c) for i, c in self._cursors.items()}
        try:
            write_private(self.cursor_file, json.dumps(saved))
        except OSError as exc:
            log.warning("cannot save log read positions to %s: %s", self.cursor_file, exc)


def _log_exists(path: Path) -> bool:
    return path.exists() or path.with_name(path.name + ".1").exists()


def _load_cursors(path: Path | None) -> dict[int, Cursor]:
    """Saved read positions; none when the file is missing or unreadable (logs then start over
    at each file's beginning, shipping some lines twice rather than none)."""
    if path is None:
        return {}
    with contextlib.suppress(OSError, ValueError, TypeError):
        saved = json.loads(path.read_text())
        return {int(i): Cursor(int(c[0]), int(c[1])) for i, c in saved.items()}
    return {}
