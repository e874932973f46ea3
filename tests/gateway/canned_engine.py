"""A stand-in engine for the gateway tests: a real asyncio HTTP/1.1 server on loopback that
answers OpenAI completions in the engine's shapes, without a model.

What it does is chosen per instance (`mode`: how every request is answered) or per request (a
`canned` field in the JSON body, which the gateway forwards untouched; the openai client sends
it as `extra_body`):

    ok (default)  a completion (chat or text, by path) with `usage` (and its `dctl` figures, as
                  our engine reports them); SSE when `stream` is true (a chat stream opens
                  with a role-only chunk; `first_delay` seconds pass before the first token),
                  with a usage chunk when `stream_options.include_usage`, and always the
                  engine's closing usage comment (`protocol.openai.usage_comment`)
    slow          SSE, `chunks` chunks (default 40) every `delay` seconds (default 0.05); with
                  `die_after` N, the connection closes after N chunks
    503 / 500     that status with an error body
    crash         a plain-text 500 from outside the API, as uvicorn answers for a handler that
                  was cancelled or crashed (no JSON error body)
    drop          the connection closed without an answer
    reset         the connection reset (RST) without an answer
    hang          no answer at all (until the connection closes)
    close         a normal answer with `connection: close`
    chunked       a normal JSON answer in chunked transfer encoding

A `canned_first` field instead answers so only the first attempt at a request (by request id,
across all canned engines): the gateway's retry elsewhere gets a normal answer.

It records what it saw (`requests`), how many connections it accepted, and the request ids of
requests whose connection the gateway closed before the end (`cut_short`: streams and hangs).
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httptools

from protocol.openai import USAGE_COMMENT_PREFIX

T = TypeVar("T")
COMPLETION_TOKENS = 7
PROMPT_TOKENS = 2
# How the engine says it decoded each request (`usage.dctl`, engine.streaming.DiffusionUsage).
FIGURES = {"steps_per_block": 3.5, "tokens_per_forward": 1.25}
_FIRST_ATTEMPTS: set[str] = set()  # request ids a `canned_first` answer was given to


class LoopThread:
    """An asyncio loop running in a daemon thread, for servers the tests talk to over TCP."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run CORO on the loop and wait for its result."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def stop(self) -> None:
        """Stop the loop."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class SeenRequest:
    """One request as the engine received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")


@dataclass
class CannedEngine:
    """One stand-in engine instance on 127.0.0.1:`port`."""

    name: str
    mode: str = "ok"
    port: int = 0
    requests: list[SeenRequest] = field(default_factory=list)
    connections: int = 0
    cut_short: list[str] = field(default_factory=list)
    server: asyncio.Server | None = None
    open: set[_Connection] = field(default_factory=set)

    async def start(self, tls: ssl.SSLContext | None = None) -> None:
        """Listen on a free loopback port."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Connection(self), "127.0.0.1", 0, ssl=tls)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening (open connections are left as they are)."""
        if self.server is not None:
            self.server.close()

    def close_idle_connections(self) -> None:
        """Close every open connection from this side, as an engine's keep-alive timeout does."""
        for conn in list(self.open):
            conn.close()

    def seen(self, request_id: str) -> list[SeenRequest]:
        """The requests that carried REQUEST_ID."""
        return [r for r in self.requests if r.request_id == request_id]


def refused_port() -> int:
    """A loopback port where nothing listens (connecting is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Connection(asyncio.Protocol):
    def __init__(self, engine: CannedEngine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.engine.connections += 1
        self.engine.open.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.engine.open.discard(self)

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        try:
            body = json.loads(b"".join(self.body) or b"{}")
        except ValueError:
            body = {}
        seen = SeenRequest(self.parser.get_method().decode(), self.url.decode(), self.headers, body)
        self._reset()
        self.engine.requests.append(seen)
        asyncio.get_running_loop().create_task(self.answer(seen))

    # answering
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def reset(self) -> None:
        """Abort with an RST, as the kernel does for a process killed mid-request."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    def head(self, status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} X", f"x-canned: {self.engine.name}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def json_answer(self, status: int, payload: Any, extra: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        headers = {"content-type": "application/json", "content-length": str(len(body))}
        self.write(self.head(status, {**headers, **(extra or {})}) + body)

    async def answer(self, request: SeenRequest) -> None:
        what = request.body.get("canned") or self.engine.mode
        first = request.body.get("canned_first")
        if first and request.request_id not in _FIRST_ATTEMPTS:
            _FIRST_ATTEMPTS.add(request.request_id)
            what = first
        if what in ("503", "500"):
            self.json_answer(int(what), {"error": {"message": f"canned {what}", "type": "x"}})
        elif what == "crash":
            body = b"Internal Server Error"
            headers = {"content-type": "text/plain; charset=utf-8", "content-length": "21"}
            self.write(self.head(500, headers) + body)
        elif what == "drop":
            self.close()
        elif what == "reset":
            self.reset()
        elif what == "hang":
            while not self.closed:  # until the gateway gives up on it
                await asyncio.sleep(0.01)
            self.engine.cut_short.append(request.request_id)
        elif what == "slow" or request.body.get("stream"):
            await self.stream(request, slow=what == "slow")
        elif what == "chunked":
            body = json.dumps(_completion(request)).encode()
            half = len(body) // 2
            chunks = b"".join(
                f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:half], body[half:])
            )
            self.write(
                self.head(200, {"content-type": "application/json", "transfer-encoding": "chunked"})
                + chunks
                + b"0\r\n\r\n"
            )
        elif what == "close":
            self.json_answer(200, _completion(request), {"connection": "close"})
            self.close()
        else:
            self.json_answer(200, _completion(request))

    async def stream(self, request: SeenRequest, *, slow: bool) -> None:
        chunks = int(request.body.get("chunks", 40 if slow else 3))
        delay = float(request.body.get("delay", 0.05)) if slow else 0.0
        self.write(
            self.head(200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"})
        )
        events = [_delta(request, f"tok{i} ") for i in range(chunks)]
        opening = request.path.endswith("/chat/completions")
        if opening:  # like the engine: a role-only chunk at once, before any token
            events.insert(0, _delta(request, "", role="assistant"))
        options = request.body.get("stream_options") or {}
        if options.get("include_usage"):
            events.append({**_delta(request, ""), "choices": [], "usage": _usage()})
        frames = [f"data: {json.dumps(event)}\n\n".encode() for event in events]
        # Like the engine: every stream ends with its usage comment, asked or not.
        comment = USAGE_COMMENT_PREFIX + json.dumps(_usage()).encode() + b"\n\n"
        frames += [comment, b"data: [DONE]\n\n"]
        die_after = int(request.body.get("die_after", -1))
        first_delay = float(request.body.get("first_delay", 0))
        for i, data in enumerate(frames):
            if first_delay and i == int(opening):  # the first token takes its time
                await asyncio.sleep(first_delay)
            if i == die_after:  # the engine process dies mid-stream
                self.close()
                return
            if self.closed:
                self.engine.cut_short.append(request.request_id)
                return
            self.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            if delay:
                await asyncio.sleep(delay)
        self.write(b"0\r\n\r\n")


def _usage() -> dict[str, Any]:
    return {
        "prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS,
        "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS, "dctl": FIGURES,
    }  # fmt: skip


def _completion(request: SeenRequest) -> dict[str, Any]:
    model = request.body.get("model", "?")
    base = {"id": "cmpl-canned", "created": int(time.time()), "model": model, "usage": _usage()}
    if request.path.endswith("/chat/completions"):
        message = {"role": "assistant", "content": "hello from the canned engine"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return {**base, "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": "hello", "finish_reason": "stop", "logprobs": None}
    return {**base, "object": "text_completion", "choices": [choice]}


def _delta(request: SeenRequest, text: str, role: str | None = None) -> dict[str, Any]:
    model = request.body.get("model", "?")
    base = {"id": "cmpl-canned", "created": int(time.time()), "model": model}
    if request.path.endswith("/chat/completions"):
        delta = {"role": role, "content": text} if role else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        return {**base, "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": None, "logprobs": None}
    return {**base, "object": "text_completion", "choices": [choice]}
