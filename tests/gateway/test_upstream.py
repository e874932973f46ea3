"""The engine client: keep-alive reuse, framing, failures, timeouts and TLS, against canned
engines on loopback."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.upstream import (
    ConnectFailed,
    Exchange,
    ExchangeBroken,
    ExchangeTimeout,
    UpstreamPool,
)
from runtime.tls import client_context
from tests.gateway.canned_engine import CannedEngine, refused_port


def _head(port: int, body: bytes, request_id: str = "r") -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: "
        f"application/json\r\nx-request-id: {request_id}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()


async def _call(pool: UpstreamPool, engine: CannedEngine, body: bytes, scheme: str = "http",
                request_id: str = "r") -> tuple[Exchange, bytes]:  # fmt: skip
    exchange = await pool.send(
        (scheme, "127.0.0.1", engine.port), _head(engine.port, body, request_id), body
    )
    chunks = []
    while (chunk := await exchange.next_chunk()) is not None:
        chunks.append(chunk)
    exchange.release()
    return exchange, b"".join(chunks)


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


def _pool(**kwargs: float) -> UpstreamPool:
    return UpstreamPool(
        connect_timeout_s=kwargs.get("connect", 2.0), timeout_s=kwargs.get("timeout", 5.0)
    )


BODY = b'{"model": "m", "prompt": "hi"}'


def test_connections_are_kept_alive_and_reused() -> None:
    async def scenario() -> None:
        engine = CannedEngine("x")
        await engine.start()
        pool = _pool()
        for _ in range(5):
            exchange, body = await _call(pool, engine, BODY)
            assert exchange.status == 200 and b'"completion_tokens": 7' in body
        assert engine.connections == 1
        assert pool.idle_count(("http", "127.0.0.1", engine.port)) == 1
        pool.close()
        await engine.stop()

    _run(scenario)


@pytest.mark.parametrize("canned", ["close", "chunked"])
def test_bodies_framed_every_way_are_read_whole(canned: str) -> None:
    async def scenario() -> None:
        engine = CannedEngine("x")
        await engine.start()
        pool = _pool()
        body = b'{"model": "m", "canned": "%s"}' % canned.encode()
        for _ in range(3):
            exchange, answer = await _call(pool, engine, body)
            assert exchange.status == 200 and answer.endswith(b"}")
        # `connection: close` is never reused; a chunked answer is.
        assert engine.connections == (3 if canned == "close" else 1)
        pool.close()

    _run(scenario)


def test_a_stream_comes_chunk_by_chunk() -> None:
    async def scenario() -> None:
        engine = CannedEngine("x")
        await engine.start()
        pool = _pool()
        body = b'{"model": "m", "canned": "slow", "chunks": 4, "delay": 0.05}'
        exchange = await pool.send(
            ("http", "127.0.0.1", engine.port), _head(engine.port, body), body
        )
        assert exchange.status == 200
        assert (b"content-type", b"text/event-stream") in exchange.headers
        pieces = []
        while (chunk := await exchange.next_chunk()) is not None:
            pieces.append(chunk)
        exchange.release()
        assert len(pieces) >= 4 and pieces[-1].endswith(b"data: [DONE]\n\n")
        assert pool.idle_count(("http", "127.0.0.1", engine.port)) == 1

    _run(scenario)


def test_a_refused_connection_is_a_connect_failure() -> None:
    async def scenario() -> None:
        port = refused_port()
        with pytest.raises(ConnectFailed, match=f"127.0.0.1:{port}"):
            await _pool().send(("http", "127.0.0.1", port), _head(port, BODY), BODY)

    _run(scenario)


def test_an_idle_connection_the_engine_closed_is_replaced_silently() -> None:
    async def scenario() -> None:
        engine = CannedEngine("x")
        await engine.start()
        pool = _pool()
        await _call(pool, engine, BODY)
        engine.close_idle_connections()
        await asyncio.sleep(0.05)
        exchange, _ = await _call(pool, engine, BODY)
        assert exchange.status == 200 and engine.connections == 2

    _run(scenario)


def test_an_unanswered_request_is_broken_and_a_silent_engine_times_out() -> None:
    async def scenario() -> None:
        engine = CannedEngine("x")
        await engine.start()
        pool = _pool(timeout=0.3)
        drop = b'{"model": "m", "canned": "drop"}'
        with pytest.raises(ExchangeBroken) as broken:
            await _call(pool, engine, drop)
        assert not broken.value.answered
        hang = b'{"model": "m", "canned": "hang"}'
        with pytest.raises(ExchangeTimeout):
            await _call(pool, engine, hang)
        # A stream that stops mid-way times out too, answered.
        slow = b'{"model": "m", "canned": "slow", "chunks": 100, "delay": 0.1}'
        with pytest.raises(ExchangeTimeout) as late:
            await _call(pool, engine, slow)
        assert late.value.answered

    _run(scenario)


def test_a_reader_that_falls_behind_holds_the_engine_back() -> None:
    """Bytes waiting for `next_chunk()` stay bounded: the connection stops reading, and the
    whole body still arrives once the reader catches up."""
    total = 8 * 2**20

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(BODY))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 2**16):
            writer.write(b"x" * 2**16)
            await writer.drain()
        writer.close()

    async def scenario() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        exchange = await _pool().send(("http", "127.0.0.1", port), _head(port, BODY), BODY)
        await asyncio.sleep(0.3)  # the engine would have sent it all by now, unhindered
        assert exchange._buffered < 2**20, "the gateway read on without a reader"
        received = 0
        while (chunk := await exchange.next_chunk()) is not None:
            received += len(chunk)
        exchange.release()
        assert received == total
        server.close()

    _run(scenario)


def test_releasing_an_unfinished_exchange_closes_the_engine_connection() -> None:
    async def scenario() -> None:
        engine = CannedEngine("x")
        await engine.start()
        pool = _pool()
        body = b'{"model": "m", "canned": "slow", "chunks": 100, "delay": 0.02}'
        exchange = await pool.send(
            ("http", "127.0.0.1", engine.port), _head(engine.port, body, "cut"), body
        )
        await exchange.next_chunk()
        exchange.release()
        for _ in range(100):
            if engine.cut_short:
                break
            await asyncio.sleep(0.01)
        assert engine.cut_short == ["cut"]
        assert pool.idle_count(("http", "127.0.0.1", engine.port)) == 0

    _run(scenario)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "engine")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "engine.pem", directory / "engine.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )  # fmt: skip
    return cert_path, key_path


def test_https_engines_are_verified_against_the_engine_ca_file(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)

    async def scenario() -> None:
        engine = CannedEngine("tls")
        await engine.start(tls=server_tls)
        trusting = UpstreamPool(connect_timeout_s=2, timeout_s=5, tls=client_context(cert))
        exchange, body = await _call(trusting, engine, BODY, scheme="https")
        assert exchange.status == 200 and body
        strangers = UpstreamPool(connect_timeout_s=2, timeout_s=5, tls=client_context())
        with pytest.raises(ConnectFailed, match=r"https://127\.0\.0\.1"):
            await _call(strangers, engine, BODY, scheme="https")

    _run(scenario)
