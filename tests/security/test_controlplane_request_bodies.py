"""Threat: a client makes the control plane read (and hold in memory) an unbounded request body,
before it even knows who is asking.

Every body now has a limit (1 MiB for ordinary routes and heartbeats, 64 MiB for a model
version's manifest), answered 413 with JSON naming it: at once for a Content-Length over it,
as soon as a chunked body passes it. The big-bodied route checks the token before it reads a
byte past the ordinary limit, so an anonymous client gets 401 without sending its body.

Raw sockets against a real control plane on loopback (SQLite and PostgreSQL): the requests are
the ones an attacker sends, which httpx would not.
"""

# Fixtures imported from tests/controlplane and live_controlplane are named again by the tests.
# ruff: noqa: F401, F811

from __future__ import annotations

import json

from controlplane.api.body_limit import MANIFEST_BODY_LIMIT, ORDINARY_BODY_LIMIT
from tests.controlplane.conftest import db_url, pg_url, sqlite_template
from tests.security.live_controlplane import (
    LiveControlPlane,
    V,
    json_of,
    live,
    raw_exchange,
    status_of,
)

MIB = 1 << 20
CHUNK = 64 * 1024


def head(path: str, token: str | None, *, length: int | None) -> bytes:
    """A POST request head: Content-Length LENGTH, or chunked when None."""
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if token:
        lines.append(f"Authorization: Bearer {token}")
    lines.append(
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunks(total: int) -> list[bytes]:
    """A chunked body of TOTAL bytes of JSON-ish filler, without the final empty chunk."""
    piece = b" " * CHUNK
    return [f"{CHUNK:x}\r\n".encode() + piece + b"\r\n" for _ in range(total // CHUNK)]


def assert_too_large(response: bytes, limit: int) -> None:
    assert status_of(response) == 413, response[:500]
    body = json_of(response)
    assert body["error"] == "payload_too_large"
    assert f"{limit >> 20} MiB ({limit} bytes)" in body["message"]


def test_an_oversized_heartbeat_is_refused_before_its_body_is_read(
    live: LiveControlPlane,
) -> None:
    agent = live.register("gpu-1")
    # Headers only: the server must answer without waiting for the 2 MiB it was promised.
    response = raw_exchange(
        live.port, head(f"{V}/agents/heartbeat", agent, length=2 * MIB), [], timeout_s=5
    )
    assert_too_large(response, ORDINARY_BODY_LIMIT)
    assert live.heartbeat(agent).status_code == 200


def test_a_chunked_heartbeat_is_cut_off_at_its_limit(live: LiveControlPlane) -> None:
    agent = live.register("gpu-1")
    # 3 MiB that never end (no final chunk): answered once 1 MiB has passed, not at the end.
    response = raw_exchange(
        live.port, head(f"{V}/agents/heartbeat", agent, length=None), chunks(3 * MIB), 10
    )
    assert_too_large(response, ORDINARY_BODY_LIMIT)
    anonymous = raw_exchange(
        live.port, head(f"{V}/agents/heartbeat", None, length=None), chunks(3 * MIB), 10
    )
    assert status_of(anonymous) in (401, 413)


def test_an_anonymous_client_cannot_make_the_server_read_a_big_body(
    live: LiveControlPlane,
) -> None:
    path = f"{V}/models/demo/versions"
    for token, status in ((None, 401), (live.token("viewer"), 403), ("dctl_x", 401)):
        # Headers only, promising 50 MiB: refused before a byte of it is read.
        declared = raw_exchange(live.port, head(path, token, length=50 * MIB), [], timeout_s=5)
        assert status_of(declared) == status, declared[:500]
        assert json_of(declared)["error"] in ("unauthorized", "forbidden")
        streamed = raw_exchange(live.port, head(path, token, length=None), chunks(2 * MIB), 10)
        assert status_of(streamed) == status, streamed[:500]
    operator = live.token("operator")
    over = raw_exchange(live.port, head(path, operator, length=65 * MIB), [], timeout_s=5)
    assert_too_large(over, MANIFEST_BODY_LIMIT)


def test_ordinary_routes_refuse_bodies_over_their_limit(live: LiveControlPlane) -> None:
    padding = "x" * (ORDINARY_BODY_LIMIT + 1)
    for path in (f"{V}/tokens", f"{V}/deployments", f"{V}/agents/register"):
        body = json.dumps({"name": "big", "role": "viewer", "notes": padding})
        response = live.call(
            "POST", path, live.admin, content=body, headers={"Content-Type": "application/json"}
        )
        assert response.status_code == 413, (path, response.text[:300])
        assert response.json()["error"] == "payload_too_large"
        assert "1 MiB" in response.json()["message"]
    # Declared small, sent big: the server reads no more than Content-Length says.
    assert live.call("GET", f"{V}/hosts", live.admin).status_code == 200


def test_a_manifest_of_many_files_still_registers(live: LiveControlPlane) -> None:
    files = [
        {"path": f"shards/layer-{i // 100:04d}/expert-{i % 100:03d}/" + "w" * 120, "size": i,
         "sha256": f"{i:064x}"}
        for i in range(20_000)
    ]  # fmt: skip
    body = {"version": "v1", "manifest": {"files": files}, "source_uri": "/nonexistent"}
    encoded = json.dumps(body)
    assert len(encoded) > 3 * ORDINARY_BODY_LIMIT
    response = live.call(
        "POST",
        f"{V}/models/demo/versions",
        live.token("operator"),
        content=encoded,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 201, response.text[:500]
