"""Receivers for rollout webhooks on 127.0.0.1, as an attacker or a careless admin runs them: an
HTTPS one with a certificate for a name only (no IP), one that drips its answer a byte at a time,
one that speaks something other than HTTP; and a resolver the tests control."""

from __future__ import annotations

import datetime as dt
import http.server
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.agent.loopback import Seen


@dataclass
class FakeDns:
    """A resolver answering from ANSWERS (name -> addresses), counting the questions."""

    answers: dict[str, list[str]]
    asked: list[str] = field(default_factory=list)

    async def __call__(self, host: str, port: int) -> list[str]:
        """The addresses of HOST (an OSError, as getaddrinfo raises, for an unknown name)."""
        self.asked.append(host)
        if host not in self.answers:
            raise OSError(f"{host}: no such name")
        return self.answers[host]


def _cert(subject: str, issuer_key: ec.EllipticCurvePrivateKey | None, *, ca: bool, name: str,
          issuer: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False
        )
    return key, builder.sign(issuer_key or key, hashes.SHA256())


def tls_for(name: str, directory: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for NAME alone (no IP address) from a fresh CA, and
    a client context trusting that CA."""
    ca_key, ca = _cert("webhook test CA", None, ca=True, name="", issuer="webhook test CA")
    key, leaf = _cert(name, ca_key, ca=False, name=name, issuer="webhook test CA")
    (directory / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (directory / "leaf.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(directory / "leaf.pem", directory / "leaf.key")
    client = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    return server, client


@contextmanager
def https_receiver(context: ssl.SSLContext) -> Iterator[tuple[int, list[Seen]]]:
    """An HTTPS server on 127.0.0.1 answering 204 to every POST; its port and what it saw."""
    seen: list[Seen] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            headers = {k.lower(): v for k, v in self.headers.items()}
            seen.append(Seen("POST", self.path, headers, self.rfile.read(length)))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), seen
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def raw_receiver(answer: bytes, *, drip_s: float | None = None) -> Iterator[int]:
    """A TCP server on 127.0.0.1 that reads a request's head and writes ANSWER: at once and
    then closes, or (DRIP_S) one byte every DRIP_S seconds, holding the connection open."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                received = b""
                while b"\r\n\r\n" not in received and (chunk := conn.recv(4096)):
                    received += chunk
                if drip_s is None:
                    conn.sendall(answer)
                    return
                for byte in answer:
                    if stop.wait(drip_s):
                        return
                    conn.sendall(bytes([byte]))
                stop.wait()
            except OSError:
                pass  # the client hung up: what a deadline does

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        listener.close()


def closed_port() -> int:
    """A port on 127.0.0.1 nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(what: str, probe: Callable[[], object], timeout_s: float = 10.0) -> float:
    """Poll PROBE until it returns something truthy; the seconds that took."""
    started = time.monotonic()
    while not probe():
        assert time.monotonic() - started < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - started
