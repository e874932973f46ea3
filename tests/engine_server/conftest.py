"""Real engine servers for the service tests: `python -m engine.serve` on free loopback ports.

Every server serves the deterministic tiny demo checkpoint (fp32, block size 4), built once
per session. `server` is shared by the whole session (2 CPU cores: start it once); tests that
need other settings (API key, a tiny queue, a short timeout) or that end the process (SIGTERM
drain) start their own with `start_server`. `raw_exchange` talks to a server over a bare
socket, for requests no HTTP client would send (any header bytes, lying lengths).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.demo_checkpoint import create_demo_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-demo"
START_TIMEOUT_S = 120.0


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """A running engine server process and what was observed while it started."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    # (live status, ready status) pairs polled before the server became ready.
    probes: list[tuple[int, int]] = field(default_factory=list)

    def log_records(self) -> list[dict[str, Any]]:
        """The server's JSON log lines so far."""
        records = []
        for line in self.log_path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records

    def metrics(self) -> dict[str, float]:
        """Scrape /metrics into {"name{label=value,...}": value}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no request is running or waiting (aborted ones are freed at the next step)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["dllm_requests_running"] == 0 and m["dllm_requests_waiting"] == 0:
                return
            time.sleep(0.1)
        raise AssertionError("the server still has requests in flight")

    def cpu_seconds(self) -> float:
        """CPU time (user + system, all threads) the server process has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


@dataclass
class RawResponse:
    """The first final (non-1xx) response read off a socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body as JSON."""
        return json.loads(self.body)


def raw_exchange(url: str, request: bytes, timeout_s: float = 20.0) -> RawResponse | None:
    """Send REQUEST's bytes as they are and read the first final response.

    None: the server closed the connection without answering. A server that neither answers
    nor closes within TIMEOUT_S fails the test (TimeoutError).
    """
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout_s) as sock:
        # It may answer (or give up) before taking everything: then read what it said.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)

        def receive() -> bytes:
            try:
                return sock.recv(65536)
            except ConnectionResetError:
                return b""

        buffer = b""
        while True:
            head, separator, rest = buffer.partition(b"\r\n\r\n")
            if not separator:
                chunk = receive()
                if not chunk:
                    return None
                buffer += chunk
                continue
            status_line, *lines = head.decode("latin-1").split("\r\n")
            status = int(status_line.split()[1])
            if 100 <= status < 200:  # "100 Continue": the answer follows
                buffer = rest
                continue
            headers = {}
            for line in lines:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            while len(rest) < length and (chunk := receive()):
                rest += chunk
            return RawResponse(status, headers, rest[:length])


def launch_server(
    tmp: Path,
    checkpoint: Path,
    service: dict[str, Any] | None = None,
    *,
    sections: dict[str, Any] | None = None,
    **model: Any,
) -> ServerProcess:
    """Write a config file and start the server process (not waiting for it); `sections`
    adds whole config sections (e.g. `chaos`)."""
    port = free_port()
    config = {
        "service": {"host": "127.0.0.1", "port": port, **(service or {})},
        "model": {"path": str(checkpoint), "served_name": MODEL, "dtype": "fp32",
                  "max_seq_len": 512, **model},
        "resources": {"device": "cpu", "threads": 1},
        "logging": {"level": "info", "format": "json"},
        **(sections or {}),
    }  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    config_path = tmp / f"engine-{port}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp / f"engine-{port}.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.serve", "--config", str(config_path)],
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)


def wait_ready(server: ServerProcess) -> ServerProcess:
    """Poll the probes until /health/ready answers 200, recording what they said meanwhile."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(
                f"server exited {server.proc.returncode}: {server.log_path.read_text()[-3000:]}"
            )
        try:
            live = httpx.get(f"{server.url}/health/live", timeout=2).status_code
            ready = httpx.get(f"{server.url}/health/ready", timeout=2).status_code
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        server.probes.append((live, ready))
        if ready == 200:
            return server
        time.sleep(0.05)
    server.stop()
    raise AssertionError(f"not ready in {START_TIMEOUT_S} s: {server.log_path.read_text()[-3000:]}")


def start_server(
    tmp: Path,
    checkpoint: Path,
    service: dict[str, Any] | None = None,
    *,
    sections: dict[str, Any] | None = None,
    **model: Any,
) -> ServerProcess:
    """Launch a server and wait until it is ready."""
    return wait_ready(launch_server(tmp, checkpoint, service, sections=sections, **model))


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo checkpoint (seed 0), written once per session."""
    return create_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", seed=0, size="tiny")


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path
) -> Iterator[ServerProcess]:
    """The shared server: 4 running + 4 waiting requests, no API key."""
    proc = start_server(
        tmp_path_factory.mktemp("server"),
        demo_checkpoint,
        {"max_concurrent_requests": 4, "max_queue": 4},
        snapshot_digest="sha256:demo0",
    )
    yield proc
    proc.stop()
