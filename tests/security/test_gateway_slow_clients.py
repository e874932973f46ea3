"""Threat: one client holds every slot of a gateway.

A request that sent its headers and a `Content-Length` but never its body held an in-flight
slot forever; a connection that sent nothing, or half its headers, was never closed; and one
token could fill all of a gateway's `max_inflight` slots, so every other client got 503.

Now a request's head must arrive within `head_timeout_s` of its first byte and its body within
`body_timeout_s` of its head (408, closed, the slot freed); a connection waiting for a request
is closed after `idle_timeout_s`; one token has at most its `--max-concurrency` (else the
gateway's `max_concurrency_per_token`) requests in flight (429 naming both); and past
`max_connections` open connections uvicorn answers 503 without calling the app.

A real `dctl gateway` process, deadlines made small with flags and `DCTL_GATEWAY_*`, in front of
the canned engines of tests/gateway; the attacker speaks HTTP/1.1 on raw sockets.
"""

# Fixtures imported from tests/gateway are named again by the tests that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cli.conftest import DCTL, free_port, isolated_env
from tests.gateway.conftest import Fleet, fleet
from tests.security.gateway_process import gateway_serving

# Generous bounds on waits that end as soon as the gateway acts: a deadline under test is 1-2 s.
PATIENCE_S = 20.0
DEFAULT_CAP = 3  # --max-concurrency-per-token
MAX_CONNECTIONS = 8


@dataclass
class Gateway:
    """The gateway process: where it listens and the fleet behind it."""

    port: int
    fleet: Fleet
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=PATIENCE_S)
        return sock

    def completion(self, token: str, **body: Any) -> httpx.Response:
        secret = self.fleet.tokens[token]
        return httpx.post(
            f"{self.url}/v1/completions", timeout=PATIENCE_S,
            json={"model": "solo-model", "prompt": "hi", **body},
            headers={"authorization": f"Bearer {secret}"},
        )  # fmt: skip

    def inflight(self) -> float:
        for line in httpx.get(f"{self.url}/metrics", timeout=PATIENCE_S).text.splitlines():
            if line.startswith("dctl_gateway_inflight "):
                return float(line.split()[1])
        raise AssertionError("no dctl_gateway_inflight in /metrics")


@pytest.fixture(scope="module")
def gateway(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    home = tmp_path_factory.mktemp("slow-clients")
    port = free_port()
    env = {
        **isolated_env(home), "DCTL_CONFIG": str(home / "absent.toml"),
        "DCTL_GATEWAY_HEAD_TIMEOUT_S": "1", "DCTL_GATEWAY_RATE_LIMIT_RPS": "0",
    }  # fmt: skip
    argv = [
        *DCTL, "gateway", "--routes-file", str(fleet.routes_file), "--port", str(port),
        "--body-timeout-s", "2", "--idle-timeout-s", "1",
        "--max-concurrency-per-token", str(DEFAULT_CAP),
        "--max-connections", str(MAX_CONNECTIONS),
    ]  # fmt: skip
    log_path = home / "gateway.log"
    with gateway_serving(argv, env, port, log_path):
        yield Gateway(port, fleet, log_path)


def read_until_closed(sock: socket.socket, trickle: bytes = b"") -> bytes:
    """Everything the gateway sends until it closes the connection (sending TRICKLE every
    0.1 s meanwhile, as a slow client would); fails if it is still open after PATIENCE_S."""
    received = b""
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], 0.1)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return received
            if not chunk:
                return received
            received += chunk
        elif trickle:
            with contextlib.suppress(OSError):  # closed meanwhile: the next read says so
                sock.sendall(trickle)
    raise AssertionError(f"the connection is still open after {PATIENCE_S} s: {received!r}")


def status_and_json(response: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head[9:12]), json.loads(body)


def request_bytes(token: str, body: bytes, declared: int | None = None, **headers: str) -> bytes:
    lines = [
        "POST /v1/completions HTTP/1.1", "host: gateway", f"authorization: Bearer {token}",
        "content-type: application/json", f"content-length: {declared or len(body)}",
        *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
    ]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def hang(gateway: Gateway, token: str) -> socket.socket:
    """A request the engine holds unanswered: its connection and its slots stay taken until the
    returned socket is closed."""
    request_id = "hang-" + uuid.uuid4().hex
    body = json.dumps({"model": "solo-model", "prompt": "hi", "canned": "hang"}).encode()
    sock = gateway.connect()
    sock.sendall(request_bytes(gateway.fleet.tokens[token], body, x_request_id=request_id))
    engine = gateway.fleet.engines["d"]
    deadline = time.monotonic() + PATIENCE_S
    while not engine.seen(request_id):
        assert time.monotonic() < deadline, "the hanging request never reached the engine"
        time.sleep(0.02)
    return sock


def wait_until(check: Any) -> None:
    deadline = time.monotonic() + PATIENCE_S
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_connection_that_sends_nothing_is_closed(gateway: Gateway) -> None:
    with gateway.connect() as sock:
        assert read_until_closed(sock) == b""


def test_a_request_head_sent_slowly_is_answered_408_and_closed(gateway: Gateway) -> None:
    with gateway.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\n")
        # Slowloris: a header line every 0.1 s, never the blank line that ends the head.
        response = read_until_closed(sock, trickle=b"x-padding: 1\r\n")
    status, body = status_and_json(response)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "head_timeout_s" in body["error"]["message"]


def test_a_declared_body_that_never_comes_is_answered_408_and_frees_its_slot(
    gateway: Gateway,
) -> None:
    with gateway.connect() as sock:
        sock.sendall(request_bytes(gateway.fleet.tokens["full"], b'{"model": ', declared=100))
        wait_until(lambda: gateway.inflight() == 1)  # the attacker holds a slot...
        response = read_until_closed(sock)
    status, body = status_and_json(response)
    assert status == 408 and body["error"]["code"] == "request_timeout"
    assert "body_timeout_s" in body["error"]["message"]
    assert gateway.inflight() == 0  # ...only until the body deadline


def test_a_body_trickled_after_its_answer_does_not_keep_the_connection(gateway: Gateway) -> None:
    with gateway.connect() as sock:
        # Refused before its body is read (no such token), then the body trickles on.
        sock.sendall(request_bytes("dctl_nosuchkey_0123456789abcdefghij", b"{", declared=10**6))
        response = read_until_closed(sock, trickle=b" ")
    assert response.startswith(b"HTTP/1.1 401 ")


def test_an_idle_keep_alive_connection_is_closed(gateway: Gateway) -> None:
    with gateway.connect() as sock:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: gateway\r\n\r\n")
        response = read_until_closed(sock)
    assert response.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in response.lower()


def test_one_token_cannot_hold_every_slot_of_the_gateway(gateway: Gateway) -> None:
    # A token created with --max-concurrency 1.
    held = hang(gateway, "capped")
    try:
        refused = gateway.completion("capped")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "concurrency_limit_exceeded"
        assert "its limit of 1" in error["message"] and "--max-concurrency N" in error["message"]
        assert gateway.completion("full").status_code == 200  # other tokens are served
    finally:
        held.close()
    wait_until(lambda: gateway.completion("capped").status_code == 200)  # its slot came back

    # A token without a cap of its own gets the gateway's --max-concurrency-per-token.
    hanging = [hang(gateway, "full") for _ in range(DEFAULT_CAP)]
    try:
        refused = gateway.completion("full")
        assert refused.status_code == 429
        message = refused.json()["error"]["message"]
        assert f"its limit of {DEFAULT_CAP}" in message and "max_concurrency_per_token" in message
    finally:
        for sock in hanging:
            sock.close()
    wait_until(lambda: gateway.inflight() == 0)


def test_connections_past_max_connections_are_refused(gateway: Gateway) -> None:
    # A token allowed 16 requests in flight holds all but one of the connections.
    hanging = [hang(gateway, "many") for _ in range(MAX_CONNECTIONS - 1)]
    try:
        refused = gateway.completion("scoped")
        assert refused.status_code == 503
    finally:
        for sock in hanging:
            sock.close()
    wait_until(lambda: gateway.completion("scoped").status_code == 200)
