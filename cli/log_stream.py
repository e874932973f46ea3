"""`dctl logs --follow`: a deployment's new log lines as the control plane streams them, and the
reconnecting that keeps the stream going when a connection drops.

`GET /api/v1/deployments/{name}/logs/follow` answers Server-Sent Events: `event: line` with
`data: <LogEntry JSON>` per line, and a `: keep-alive` comment about every 15 s between. The
stream starts after the cursor it is given (`after`, a line's id), so a connection opened again
after the last line shown neither repeats nor skips one. The control plane ends each stream
after a while (`max_s`, 5 minutes), as a watch does: the next one is opened at once. A
connection that fails, or stays silent for `READ_TIMEOUT_S` (a few missed keep-alives), is
opened again after each of `RECONNECT_DELAYS_S`; when all of those attempts fail in a row,
`follow` gives up with the reason and the cursor to resume from. An answer that reconnecting
cannot change (a 4xx: no such deployment, a bad filter, a token that may not read logs) ends
it at once.

The client's `ControlPlaneClient` answers whole JSON bodies; this is the one streamed call, made
with the same context, TLS verification and error messages.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import httpx

    from client.credentials import Context
    from protocol.logs import LogEntry

# Keep-alives come about every 15 s: three missed ones mean the connection is dead.
READ_TIMEOUT_S = 45.0
# Waits before each attempt to reconnect; an attempt that brings anything back (a line or a
# keep-alive) starts the count again. About 15 s in all: a control plane restarting is back.
RECONNECT_DELAYS_S: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0)


class StreamDropped(Exception):
    """The stream ended or could not be opened; opening it again may help."""


class StreamRefused(Exception):
    """The control plane refused the stream in a way reconnecting cannot change (a 4xx)."""


class FollowFailed(Exception):
    """Reconnecting failed every time; `reason` is the last failure, `after` the cursor of the
    last line shown (the stream resumes there)."""

    def __init__(self, reason: str, after: int, attempts: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after = after
        self.attempts = attempts


@dataclass(frozen=True)
class SseEvent:
    """One dispatched Server-Sent Event."""

    event: str
    data: str
    id: str | None = None


def sse_events(lines: Iterable[str]) -> Iterator[SseEvent | None]:
    """The events of an SSE stream's lines, and None for each comment (a keep-alive).

    The rules of the format this stream uses: `field: value` lines (one leading blank dropped),
    `data` lines joined by newlines, an event dispatched at a blank line, `:` lines comments.
    """
    event, ident = "", None
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r")
        if not line:
            if data:
                yield SseEvent(event or "message", "\n".join(data), ident)
            event, data = "", []
            continue
        if line.startswith(":"):
            yield None
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            ident = value


class EntrySource(Protocol):
    """Where `follow` reads lines from: one connection per call of `entries`."""

    def entries(self, after: int) -> Iterator[LogEntry | None]:
        """Lines after cursor AFTER as they arrive (None for a keep-alive), until the stream
        ends; `StreamDropped` or `StreamRefused` when it fails."""
        ...


class LogStream:
    """The follow endpoint of one deployment with its filters, opened once per `entries` call."""

    def __init__(
        self,
        context: Context,
        path: str,
        params: Mapping[str, Any],
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.context = context
        self.path = path
        self.params = dict(params)
        self.read_timeout_s = read_timeout_s
        self.transport = transport

    def _client(self) -> httpx.Client:
        import httpx

        from runtime.tls import TlsError, client_context

        headers = {"Accept": "text/event-stream"}
        if self.context.token:
            headers["Authorization"] = f"Bearer {self.context.token}"
        try:
            verify = client_context(self.context.ca_file)
        except TlsError as exc:
            raise StreamRefused(str(exc)) from None
        return httpx.Client(
            base_url=self.context.url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(10.0, read=self.read_timeout_s),
            transport=self.transport,
            verify=verify,
        )

    def entries(self, after: int) -> Iterator[LogEntry | None]:
        """Lines after cursor AFTER as the control plane sends them (None for a keep-alive)."""
        import httpx

        from client.errors import ClientError, error_message, transport_errors

        base = self.context.url.rstrip("/")
        with self._client() as http:
            request = http.build_request("GET", self.path, params={**self.params, "after": after})
            try:
                with transport_errors(base):
                    response = http.send(request, stream=True)
            except ClientError as exc:
                raise StreamDropped(str(exc)) from None
            try:
                if response.status_code != 200:
                    response.read()
                    message = f"{error_message(response)} (HTTP {response.status_code})"
                    retry = response.status_code >= 500 or response.status_code in (408, 429)
                    raise (StreamDropped if retry else StreamRefused)(message)
                try:
                    for event in sse_events(response.iter_lines()):
                        yield None if event is None else _entry(event)
                except httpx.HTTPError as exc:
                    raise StreamDropped(
                        f"the stream from {base} broke: {exc or type(exc).__name__}"
                    ) from None
            finally:
                response.close()


def _entry(event: SseEvent) -> LogEntry | None:
    """The line an event carries; None for events of other kinds (keep the stream open)."""
    from pydantic import ValidationError

    from protocol.logs import LogEntry
    from protocol.wire import STORED

    if event.event != "line":
        return None
    try:
        return LogEntry.model_validate(json.loads(event.data), context=STORED)
    except (ValueError, ValidationError) as exc:
        # Client and server ship together: a line of another shape is another dctl version.
        raise StreamRefused(
            f"the control plane sent a log line this dctl cannot read ({str(exc).splitlines()[0]});"
            " are the CLI and the control plane the same version?"
        ) from None


def follow(
    source: EntrySource,
    after: int,
    show: Callable[[LogEntry], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
    delays: Sequence[float] = RECONNECT_DELAYS_S,
) -> None:
    """SHOW each line after cursor AFTER as it arrives, until interrupted (KeyboardInterrupt
    passes through). A dropped stream is opened again after the last line shown, after each of
    DELAYS; `FollowFailed` once every attempt failed in a row, `StreamRefused` at once."""
    attempt = 0
    while True:
        received = False
        try:
            for entry in source.entries(after):
                received, attempt = True, 0  # it works: a later drop gets every attempt again
                if entry is not None:
                    show(entry)
                    after = max(after, entry.id)
            if received:
                continue  # a bounded stream that ended as it does (`max_s`): open the next one
            reason = "the control plane ended the stream"
        except StreamDropped as exc:
            reason = str(exc)
        if attempt >= len(delays):
            raise FollowFailed(reason, after, attempt)
        sleep(delays[attempt])
        attempt += 1
