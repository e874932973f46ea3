"""Real HTTP servers on 127.0.0.1 playing a control plane, a file server or an attacker.

`LoopbackServer` answers every request through one route function and records what it was sent
(method, path, headers, body) and how many body bytes it managed to write back. A route may
answer with an endless body (an iterator), to see where the agent stops reading.
`FakeControlPlane` speaks the agent wire protocol on top of it: registration, heartbeats whose
reply is whatever raw JSON the test puts in `instances`, and snapshot files with Range support.
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agent.control_plane import ControlPlaneLink
from agent.gpu import BackendSelection, FakeBackend
from agent.main_loop import Agent, AgentConfig
from agent.preflight import PreflightReport
from agent.snapshots import SnapshotStore
from agent.supervisor import Supervisor
from protocol.manifest import compute_manifest
from protocol.wire import (
    HEARTBEAT_PATH,
    REGISTER_PATH,
    Heartbeat,
    ObservedInstance,
    PreflightCheck,
)
from tests.agent.fakes import FakeLauncher, Health
from tests.clock import FakeClock

FILES_PREFIX = "/api/v1/models/demo/versions/v1/files/"


@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def authorization(self) -> str | None:
        """The Authorization header, if any."""
        return self.headers.get("authorization")


Body = bytes | Iterable[bytes]
Answer = tuple[int, dict[str, str], Body]
Route = Callable[[Seen], Answer]


def endless(chunk: bytes = b"\0" * 65536, stop: threading.Event | None = None) -> Iterator[bytes]:
    """An endless body (until STOP is set): what a hostile server sends."""
    while stop is None or not stop.is_set():
        yield chunk


class LoopbackServer:
    """A threaded HTTP server on 127.0.0.1 answering through ROUTE; a context manager."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.seen: list[Seen] = []
        self.bytes_sent = 0
        self.stop = threading.Event()  # ends endless bodies at shutdown
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen = Seen(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(length) if length else b"",
                )
                owner.seen.append(seen)
                status, headers, body = owner.route(seen)
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if isinstance(body, bytes) and "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                chunks: Iterable[bytes] = [body] if isinstance(body, bytes) else body
                try:
                    for chunk in chunks:
                        if owner.stop.is_set():
                            break
                        self.wfile.write(chunk)
                        owner.bytes_sent += len(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading: that is what some tests want to see

            do_GET = do_POST = _serve

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False  # a handler stuck writing must not hang shutdown
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._server.shutdown()
        self._server.server_close()


def recording_server() -> LoopbackServer:
    """A server that answers every request 200 with a few bytes: an attacker's collector."""
    return LoopbackServer(lambda seen: (200, {}, b"weights"))


def file_answer(data: bytes, range_header: str | None) -> Answer:
    """A well-behaved file server's answer: 200, or 206 with Content-Range for `bytes=N-`."""
    if range_header:
        start = int(range_header.removeprefix("bytes=").rstrip("-"))
        content_range = f"bytes {start}-{len(data) - 1}/{len(data)}"
        return 206, {"Content-Range": content_range}, data[start:]
    return 200, {}, data


@dataclass
class FakeControlPlane:
    """The agent protocol over real HTTP, with a desired state the test writes as raw JSON.

    PREFIX is the path the control plane is mounted under (behind a proxy, say); FILES is the
    directory served as the model version's files at PREFIX + `FILES_PREFIX`.
    """

    prefix: str = ""
    files: Path | None = None
    agent_token: str = "agent-secret-token"
    interval_s: float = 0.2
    refuse_registration: bool = False
    instances: list[dict[str, Any]] = field(default_factory=list)
    beats: list[Heartbeat] = field(default_factory=list)
    generation: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        self.server = LoopbackServer(self.route)

    @property
    def url(self) -> str:
        """The control-plane URL the agent is configured with."""
        return self.server.url + self.prefix

    def __enter__(self) -> FakeControlPlane:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)

    def route(self, seen: Seen) -> Answer:
        """Registration, heartbeats and files; 404 for anything else."""
        path = seen.path.removeprefix(self.prefix) if seen.path.startswith(self.prefix) else ""
        if seen.method == "POST" and path == REGISTER_PATH:
            if self.refuse_registration:
                return 401, {}, b'{"error": {"message": "bootstrap token refused"}}'
            reply = {"host_id": 1, "host_name": "gpu-1", "agent_token": self.agent_token,
                     "heartbeat_interval_s": self.interval_s}  # fmt: skip
            return 200, {}, json.dumps(reply).encode()
        if seen.method == "POST" and path == HEARTBEAT_PATH:
            if seen.authorization != f"Bearer {self.agent_token}":
                return 401, {}, b'{"error": {"message": "unknown token"}}'
            self.beats.append(Heartbeat.model_validate_json(seen.body))
            reply = {"generation": next(self.generation), "host_id": 1,
                     "heartbeat_interval_s": self.interval_s,
                     "server_time": datetime.now(UTC).isoformat(),
                     "instances": self.instances}  # fmt: skip
            return 200, {}, json.dumps(reply).encode()
        if seen.method == "GET" and path.startswith(FILES_PREFIX) and self.files is not None:
            if seen.authorization != f"Bearer {self.agent_token}":
                return 401, {}, b""
            target = self.files / path.removeprefix(FILES_PREFIX)
            if target.is_file():
                return file_answer(target.read_bytes(), seen.headers.get("range"))
        return 404, {}, b'{"error": {"message": "not found"}}'

    def observed(self) -> dict[int, ObservedInstance]:
        """The instances the last heartbeat reported, by id."""
        return {o.instance_id: o for o in self.beats[-1].instances} if self.beats else {}

    def requests_with_token(self) -> list[Seen]:
        """Every request this server received carrying the agent token."""
        return [s for s in self.server.seen if self.agent_token in (s.authorization or "")]


def agent_for(
    tmp_path: Path,
    control_plane: str,
    launcher: FakeLauncher | None = None,
    model_roots: list[Path] | None = None,
) -> Agent:
    """An agent talking real HTTP to CONTROL_PLANE (`ControlPlaneLink`, `SnapshotStore`), with
    fake GPUs and a fake launcher (no engine process is started). It copies local sources from
    below MODEL_ROOTS (default: TMP_PATH)."""
    launcher = launcher or FakeLauncher()
    roots = [tmp_path] if model_roots is None else model_roots
    supervisor = Supervisor(tmp_path / "data" / "agent" / "run", launcher, Health(),
                            clock=FakeClock().monotonic, engine_command=["engine-bin"])  # fmt: skip
    return Agent(
        AgentConfig(control_plane=control_plane, data_dir=tmp_path / "data",
                    bootstrap_token="bootstrap-secret", host_name="gpu-1"),
        BackendSelection("fake", FakeBackend("2xH100")),
        PreflightReport([PreflightCheck(name="nvml", status="pass")]),
        SnapshotStore(tmp_path / "data" / "snapshots", model_roots=roots),
        supervisor,
        ControlPlaneLink(control_plane, timeout_s=5.0),
    )  # fmt: skip


def settle(agent: Agent, timeout_s: float = 10.0) -> None:
    """Heartbeat, wait for the snapshot worker, reconcile its result, heartbeat again."""
    agent.heartbeat_once()
    deadline = time.monotonic() + timeout_s
    while agent.fetcher.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
        agent.step()
    agent.supervisor.tick()
    agent.heartbeat_once()


def checkpoint(root: Path, seed: int = 1) -> Path:
    """A small checkpoint directory (config.json plus a weights file)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(f'{{"seed": {seed}}}')
    (root / "model.safetensors").write_bytes(bytes(range(256)) * (seed + 1))
    return root


def desired_instance(
    src: Path, instance_id: int = 5, source_uri: str | None = None, **fields: Any
) -> dict[str, Any]:
    """A desired instance as the control plane sends it (raw JSON, so tests can break it)."""
    manifest = compute_manifest(src)
    model = {"name": "demo", "version": "v1", "digest": manifest.digest(),
             "manifest": manifest.model_dump(mode="json"), "source_uri": source_uri or str(src),
             "files_url": fields.pop("files_url", None)}  # fmt: skip
    return {"instance_id": instance_id, "deployment": "demo", "port": 18000 + instance_id,
            "model": model, **fields}  # fmt: skip


def wait_until(what: str, probe: Callable[[], object], timeout_s: float = 30.0) -> None:
    """Poll PROBE until it is truthy; fail naming WHAT."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probe():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def agent_command(control_plane: str, data_dir: Path, *extra: str) -> list[str]:
    """`dctl agent` on fake GPUs against CONTROL_PLANE, as a user (or root, allowed) runs it."""
    argv = [sys.executable, "-m", "cli", "agent", "--control-plane", control_plane,
            "--data-dir", str(data_dir), "--gpu-backend", "fake", "--metrics-port", "0",
            "--stop-engines-on-exit", *extra]  # fmt: skip
    return argv + (["--allow-root"] if os.geteuid() == 0 else [])


def agent_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The test's environment without its DCTL_* settings or config file, plus EXTRA."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    return {**env, "DCTL_CONFIG": str(tmp_path / "no-config.toml"), **extra}


def run_agent(tmp_path: Path, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start `dctl agent`; its stderr goes to tmp_path / agent.log (see `agent_log`)."""
    log = (tmp_path / "agent.log").open("w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def agent_log(tmp_path: Path) -> str:
    """What the agent process wrote so far."""
    return (tmp_path / "agent.log").read_text()
