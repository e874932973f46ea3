"""A loopback HTTP server with canned control-plane answers, for CLI tests of what a command
sends and how it prints what comes back (the control plane's side is tested in tests/controlplane).

Besides JSON answers it can answer Server-Sent Events (`stream`): each connection to the path
gets the next canned `Stream`, written out, then the connection closed (a drop) or held open.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Stream:
    """One canned SSE connection: its status, the text written, and whether it stays open
    afterwards (until the server closes) or is closed at once (the stream drops)."""

    chunks: list[str] = field(default_factory=list)
    hold: bool = False
    status: int = 200


def sse_line(entry: dict[str, Any]) -> str:
    """One `event: line` event carrying ENTRY as its JSON data."""
    return f"event: line\ndata: {json.dumps(entry)}\n\n"


class CannedApi:
    """Answers (METHOD, PATH) with the next of its canned (status, body) pairs, the last one
    for good; records every request."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        self.streams: dict[str, list[Stream]] = {}
        self.closing = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                api.requests.append((self.command, self.path, body))
                streams = api.streams.get(self.path.split("?")[0])
                if self.command == "GET" and streams:
                    self._stream(streams.pop(0) if len(streams) > 1 else streams[0])
                    return
                unknown = [(404, {"code": "not_found", "message": "no such route"})]
                queue = api.answers.get((self.command, self.path.split("?")[0]), unknown)
                status, reply = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, stream: Stream) -> None:
                self.send_response(stream.status)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in stream.chunks:
                    self.wfile.write(chunk.encode())
                    self.wfile.flush()
                if stream.hold:
                    api.closing.wait(30)
                self.close_connection = True

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(
            target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def on(self, method: str, path: str, *answers: tuple[int, Any]) -> None:
        self.answers[(method, path)] = list(answers)

    def stream(self, path: str, *streams: Stream) -> None:
        """Answer GET PATH with these SSE connections in turn, the last one for good."""
        self.streams[path] = list(streams)

    def queries(self, path: str) -> list[dict[str, list[str]]]:
        """The query parameters of each request to PATH, in order."""
        from urllib.parse import parse_qs, urlsplit

        return [parse_qs(urlsplit(p).query) for _, p, _ in self.requests if p.split("?")[0] == path]

    def bodies(self, method: str, path: str) -> list[Any]:
        return [body for m, p, body in self.requests if m == method and p.split("?")[0] == path]

    def close(self) -> None:
        """Stop serving (held streams end) and free the port."""
        self.closing.set()
        self.http.shutdown()
        self.http.server_close()
