"""The gateway's request log: one JSON line per completion request (`RequestSummary`), in a file
that rotates by size, for Loki, Vector or Fluent Bit to ship as it is: the field names are the
model's and `time` is RFC 3339 in UTC, so no custom parser is needed. Refusals are lines too
(status 401, 429, ...; `deployment` is '' when the gateway refused before knowing it). The
client token is named, never its secret.

Written off the request path: `write` appends to a bounded queue and returns; a writer thread
serializes and writes what has queued every `flush_s` (sooner when the queue fills), flushing
after each batch, so a tailer sees a line within moments. When the disk cannot keep up (or
fails), lines are dropped and counted (`dctl_gateway_request_log_lines_total{outcome=
"dropped"}`): a slow disk never slows requests.

Rotation as logrotate and Python's `RotatingFileHandler` name it, which shippers follow: past
`max_bytes` the file becomes FILE.1, FILE.1 becomes FILE.2, and so on; the oldest of
`max_files` files is deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from pathlib import Path
from typing import BinaryIO, Protocol

from protocol.logs import RequestSummary

log = logging.getLogger("dctl.gateway")

QUEUE_LINES = 10_000  # lines waiting for the writer at most (a few MiB)
FLUSH_S = 0.2


class LineCounter(Protocol):
    """What counts lines: a Prometheus counter child."""

    def inc(self, amount: float = 1) -> None:
        """Add AMOUNT."""
        ...


class RequestLog:
    """The JSONL request log at PATH, written once `start`ed. Opening it raises `OSError` when
    it cannot be written."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int,
        max_files: int,
        written: LineCounter,
        dropped: LineCounter,
        queue_lines: int = QUEUE_LINES,
        flush_s: float = FLUSH_S,
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.queue_lines = queue_lines
        self.flush_s = flush_s
        self._written = written
        self._dropped = dropped
        self._file: BinaryIO | None = self._open()
        self._size = self._file.tell()
        self._queue: deque[RequestSummary] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)

    def start(self) -> None:
        """Start the writer thread."""
        self._thread.start()

    def write(self, summary: RequestSummary) -> None:
        """Queue SUMMARY's line; never blocks. A full queue drops it (counted)."""
        queued = len(self._queue)
        if queued >= self.queue_lines or self._closing:
            self._dropped.inc()
            return
        self._queue.append(summary)
        if queued == self.queue_lines // 2:  # filling up: do not wait for the next flush
            self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued and close the file (within TIMEOUT_S)."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        else:  # never started
            self._drain()
            self._close_file()

    # --- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            closing = self._closing
            self._drain()
            if closing:
                break
        self._close_file()

    def _drain(self) -> None:
        summaries: list[RequestSummary] = []
        with contextlib.suppress(IndexError):
            while True:
                summaries.append(self._queue.popleft())
        if not summaries:
            return
        try:
            self._write([s.model_dump_json().encode() + b"\n" for s in summaries])
        except Exception as exc:  # the disk (OSError), or anything else: the writer lives on
            self._dropped.inc(len(summaries))
            if not self._failing:
                log.warning(
                    "cannot write the request log %s (lines dropped until it works again): %s",
                    self.path, exc,
                )  # fmt: skip
            self._failing = True
            self._close_file()  # opened again for the next batch
            return
        self._written.inc(len(summaries))
        if self._failing:
            log.info("request log %s written again", self.path)
            self._failing = False

    def _write(self, lines: list[bytes]) -> None:
        if self._file is None:
            self._file = self._open()
            self._size = self._file.tell()
        pending: list[bytes] = []
        for line in lines:
            if self._size and self._size + len(line) > self.max_bytes:
                self._file.write(b"".join(pending))
                pending = []
                self._file = self._rotate()
            pending.append(line)
            self._size += len(line)
        self._file.write(b"".join(pending))
        self._file.flush()

    def _rotate(self) -> BinaryIO:
        self._close_file()
        for n in range(self.max_files - 1, 0, -1):
            older = self._numbered(n - 1)
            if older.exists():
                os.replace(older, self._numbered(n))
        if self.max_files == 1:
            self.path.unlink(missing_ok=True)
        self._size = 0
        return self._open()

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # what it could not flush is counted already
                self._file.close()
        self._file = None

    def _numbered(self, n: int) -> Path:
        return self.path if n == 0 else self.path.with_name(f"{self.path.name}.{n}")

    def _open(self) -> BinaryIO:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return open(self.path, "ab", opener=_private)


def _private(path: str, flags: int) -> int:
    """Open with mode 0640: token names and traffic are nobody else's business."""
    return os.open(path, flags, 0o640)
