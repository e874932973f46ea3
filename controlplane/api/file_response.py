"""An HTTP response streaming an already opened file, whole or one byte range (RFC 9110 §14).

Starlette's `FileResponse` opens a path; serving a verified file must read the very descriptor
that was verified, so this one reads from a descriptor (`pread`, in a thread) instead. One
range is enough for the agent, which resumes with `Range: bytes=N-` and checks
`Content-Range`; several ranges, another unit or a malformed header get the whole file, as the
RFC allows.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator, Mapping

from anyio import to_thread
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from controlplane.model_files import OpenedFile

CHUNK = 1 << 20
# At most 19 digits: a longer number is no file offset (and int() refuses over 4300 digits).
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d{0,19})\s*-\s*(\d{0,19})\s*$")


class RangeNotSatisfiable(Exception):
    """The one range asked for starts at or past the end of the file."""


class FileChanged(RuntimeError):
    """The file changed while it was served: the transfer is cut (the client retries)."""


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte positions a `Range` header asks of SIZE bytes.

    None means the whole file: no header, or one this server ignores. Raises
    `RangeNotSatisfiable` for a range that starts at or past the end.
    """
    match = _RANGE.match(header) if header else None
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.groups()
    if first == "":  # a suffix: the last N bytes
        count = int(last)
        if count == 0 or size == 0:
            raise RangeNotSatisfiable
        return max(size - count, 0), size - 1
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if last != "" and int(last) < start:
        return None  # an invalid range: the RFC says to ignore the header
    if start >= size:
        raise RangeNotSatisfiable
    return start, end


class OpenFileResponse(StreamingResponse):
    """The bytes of OPENED (closed when the response ends), whole or the range asked for."""

    def __init__(self, opened: OpenedFile, request_headers: Mapping[str, str], etag: str) -> None:
        self.opened = opened
        size = opened.identity.size
        headers = {"Accept-Ranges": "bytes", "ETag": etag}
        wanted = request_headers.get("range")
        if_range = request_headers.get("if-range")
        # A resumed download of a different file version must start over: ignore the range.
        if if_range is not None and if_range.strip() != etag:
            wanted = None
        first, last, status = 0, size - 1, 200
        span = byte_range(wanted, size)
        if span is not None:
            (first, last), status = span, 206
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        headers["Content-Length"] = str(last - first + 1)
        super().__init__(
            self._chunks(first, last + 1),
            status_code=status,
            headers=headers,
            media_type="application/octet-stream",
        )

    async def _chunks(self, start: int, end: int) -> AsyncIterator[bytes]:
        offset = start
        while offset < end:
            chunk = await to_thread.run_sync(self._read, offset, min(CHUNK, end - offset))
            offset += len(chunk)
            yield chunk

    def _read(self, offset: int, count: int) -> bytes:
        # Bytes of a file written after its verification are not the verified bytes: stop.
        if not self.opened.unchanged():
            raise FileChanged(f"the file changed while it was served (at byte {offset})")
        chunk = os.pread(self.opened.fd, count, offset)
        if not chunk:
            raise FileChanged(f"the file ended early while it was served (at byte {offset})")
        return chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Stream the file, then close it however the response ended."""
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.opened.close()


def range_not_satisfiable(opened: OpenedFile) -> Response:
    """HTTP 416 for a range past the end, saying how long the file is (and closing it)."""
    size = opened.identity.size
    opened.close()
    message = f"the range asked for starts past the end of the file ({size} bytes): ask for less"
    return JSONResponse(
        {"error": "range_not_satisfiable", "message": message, "details": []},
        status_code=416,
        headers={"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"},
    )
