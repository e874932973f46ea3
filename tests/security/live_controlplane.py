"""A real control plane for the security tests: the app served by uvicorn on a loopback port,
over SQLite and PostgreSQL (tests/controlplane/conftest.py's `db_url`), with an injected clock.
The tests talk to it over TCP, as an attacker would, with httpx or a raw socket."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.engine import Engine

from controlplane.app import create_app
from controlplane.bootstrap import ensure_admin_token
from controlplane.db import make_engine
from controlplane.settings import ControlPlaneSettings
from tests.clock import FakeClock
from tests.uvicorn_thread import serve_in_thread

V = "/api/v1"


@dataclass
class LiveControlPlane:
    """A control plane listening on 127.0.0.1:`port`, its admin token and helpers."""

    url: str
    port: int
    app: FastAPI
    engine: Engine
    clock: FakeClock
    admin: str
    http: httpx.Client = field(repr=False)

    def call(self, method: str, path: str, token: str | None, **kwargs: Any) -> httpx.Response:
        """One request over TCP with `token` (None: no Authorization header)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        headers.update(kwargs.pop("headers", {}))
        return self.http.request(method, path, headers=headers, **kwargs)

    def token(self, role: str, **extra: Any) -> str:
        """A new token of `role`, minted with the admin token; its secret."""
        body = {"name": f"t-{role}-{uuid.uuid4().hex[:6]}", "role": role, **extra}
        created = self.call("POST", f"{V}/tokens", self.admin, json=body)
        assert created.status_code == 201, created.text
        return str(created.json()["secret"])

    def register(self, name: str, token: str | None = None) -> str:
        """Register host `name` (with a fresh bootstrap token unless given); its agent token."""
        reply = self.call(
            "POST", f"{V}/agents/register", token or self.token("bootstrap"), json={"name": name}
        )
        assert reply.status_code == 200, reply.text
        return str(reply.json()["agent_token"])

    def heartbeat(self, token: str | None, **body: Any) -> httpx.Response:
        """One heartbeat."""
        return self.call("POST", f"{V}/agents/heartbeat", token, json=body)

    def tokens(self) -> list[dict[str, Any]]:
        """Every token (revoked ones too), as the admin lists them."""
        listed = self.call("GET", f"{V}/tokens", self.admin, params={"include_revoked": True})
        rows: list[dict[str, Any]] = listed.json()
        return rows


def serve(db_url: str, **settings: Any) -> Iterator[LiveControlPlane]:
    """Run the app on `db_url` in a uvicorn thread until the generator is closed."""
    clock = FakeClock()
    engine = make_engine(db_url)
    admin = ensure_admin_token(engine, clock())
    assert admin is not None
    app = create_app(
        ControlPlaneSettings(database_url=db_url, **settings),
        clock=clock,
        engine=engine,
        run_controllers=False,
    )
    try:
        with (
            serve_in_thread(app, log_level="warning", lifespan="on", server_header=False) as url,
            httpx.Client(base_url=url, timeout=30) as http,
        ):
            port = int(url.rsplit(":", 1)[1])
            yield LiveControlPlane(url, port, app, engine, clock, admin, http)
    finally:
        engine.dispose()


@pytest.fixture
def live(db_url: str) -> Iterator[LiveControlPlane]:
    """The control plane on a fresh database of each kind, served on loopback."""
    yield from serve(db_url)


def raw_exchange(port: int, head: bytes, body_parts: list[bytes], timeout_s: float) -> bytes:
    """Send a request head and body parts on a raw socket, then read what comes back.

    For what httpx will not send: a Content-Length larger than the body that follows, or a
    chunked body that never ends. Returns the response bytes read before the server closed the
    connection or `timeout_s` passed (b"" when nothing came).
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed: stop sending
                break
        received = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                break
            if not chunk:
                break
            received += chunk
            if b"\r\n\r\n" in received and _complete(received):
                break
        return received


def _complete(response: bytes) -> bool:
    head, _, body = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP response (0 for none)."""
    return int(response[9:12]) if response.startswith(b"HTTP/1.1 ") else 0


def json_of(response: bytes) -> dict[str, Any]:
    """The JSON body of a raw HTTP response."""
    import json

    data: dict[str, Any] = json.loads(response.partition(b"\r\n\r\n")[2])
    return data
