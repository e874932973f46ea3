"""A loopback HTTP server with canned control-plane answers, for CLI tests of what a command
sends and how it prints what comes back (the control plane's side is tested in tests/controlplane).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CannedApi:
    """Answers (METHOD, PATH) with the next of its canned (status, body) pairs, the last one
    for good; records every request."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self.requests: list[tuple[str, str, Any]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                api.requests.append((self.command, self.path, body))
                unknown = [(404, {"code": "not_found", "message": "no such route"})]
                queue = api.answers.get((self.command, self.path.split("?")[0]), unknown)
                status, reply = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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

    def bodies(self, method: str, path: str) -> list[Any]:
        return [body for m, p, body in self.requests if m == method and p.split("?")[0] == path]

    def close(self) -> None:
        """Stop serving and free the port."""
        self.http.shutdown()
        self.http.server_close()
