"""Engine processes as the supervisor sees them: launch, adopt, signal, probe, pid files, logs.

Engines run in their own session, so they outlive an agent restart (the new agent re-adopts them
from their pid files) and a Ctrl-C aimed at the agent does not reach them. That session's process
group is the instance: a parallel engine (`parallel.size` > 1) is rank 0, which starts the other
ranks as its children in its group. SIGTERM goes to rank 0 alone (it drains, then ends its
ranks); SIGKILL goes to the whole group; and once rank 0 has exited, whatever is left of its
group is killed before it counts as ended, so no rank outlives its instance or holds a GPU
into the next start. Their output goes
straight to a log file, never through a pipe the agent holds: a pipe would break when the agent
restarts and take the engine down with it. Logs are rotated on each (re)start and copy-truncated
when they grow past the limit while the engine runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from agent.private_files import write_private

log = logging.getLogger("dctl.agent")

# The largest /metrics body the agent reads. The biggest legitimate page is a MoE engine's
# `dllm_expert_tokens_total{layer,expert}`: one ~64-byte line per (layer, expert), so 64 layers x
# 256 experts = 16 384 lines is about 1.0 MiB (measured with the engine's own collector and
# 9-digit counts), plus a few KiB of everything else. 4 MiB leaves ~4x headroom for more layers,
# experts or longer counts, while an endless or hostile body costs the agent at most 4 MiB a scrape.
METRICS_BODY_LIMIT = 4 << 20
_IDENTITY = {"Accept-Encoding": "identity"}


class EngineProcess(Protocol):
    """A running (or finished) engine process."""

    pid: int

    def poll(self) -> int | None:
        """None while running; the exit code once it ended (negative: killed by that signal),
        by which time none of its process group is left."""
        ...

    def send(self, sig: int) -> None:
        """Deliver a signal: SIGKILL to its whole process group, any other to the engine
        itself; a process that already ended is ignored."""
        ...


class Launcher(Protocol):
    """Starts engine processes and finds ones started by an earlier agent."""

    def launch(self, argv: list[str], env: dict[str, str], log_path: Path) -> EngineProcess:
        """Start ARGV with its output appended to LOG_PATH."""
        ...

    def adopt(self, pid: int, marker: str) -> EngineProcess | None:
        """The process PID if it is alive and its command line contains MARKER, else None."""
        ...


class Prober(Protocol):
    """Answers whether an engine endpoint returns 200."""

    def __call__(self, host: str, port: int, path: str) -> bool:
        """True when GET http(s)://HOST:PORT/PATH answers 200 in time."""
        ...


def engine_url(host: str, port: int, path: str, tls: bool = False) -> str:
    """http(s)://HOST:PORT/PATH, with an IPv6 HOST in brackets."""
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}{path}" if ":" in host else f"{scheme}://{host}:{port}{path}"


def _signal(pid: int, sig: int) -> None:
    """SIGKILL to PID's process group (every rank of the engine), any other signal to PID."""
    with contextlib.suppress(ProcessLookupError):
        if sig == SIGKILL:
            _kill_group(pid)
        else:
            os.kill(pid, sig)


def _kill_group(leader: int) -> None:
    """SIGKILL every process of the group LEADER started (`start_new_session`); just LEADER
    when it leads no group of its own (an engine started otherwise), never the agent's."""
    try:
        group = os.getpgid(leader)
    except ProcessLookupError:
        group = leader  # the leader is gone, its group may not be: its id is still the group's
    if group == leader and group != os.getpgrp():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, SIGKILL)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(leader, SIGKILL)


class ChildProcess:
    """An engine this agent started, the leader of its own process group."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid

    def poll(self) -> int | None:
        """Exit code once ended, reaping the child after killing what is left of its group."""
        if self._popen.returncode is not None:
            return self._popen.returncode
        exited = _exited_unreaped(self.pid)
        if exited:
            # Still unreaped, the engine holds its pid, so the group id cannot have passed to
            # another process: its leftover ranks are killed, and nothing else.
            _kill_group(self.pid)
        code = self._popen.poll()
        if code is not None and exited is None:
            _kill_group(self.pid)  # just after reaping: pids are not reused that fast
        return code

    def send(self, sig: int) -> None:
        """Signal the child (SIGKILL: its whole group) if it still runs."""
        if self.poll() is None:
            _signal(self.pid, sig)


def _exited_unreaped(pid: int) -> bool | None:
    """Whether our child PID has exited, without reaping it; None where the system cannot tell
    (no `waitid`: macOS)."""
    if not hasattr(os, "waitid"):
        return None
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


class AdoptedProcess:
    """An engine an earlier agent started: not our child, so its exit code cannot be read."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._gone = False

    def poll(self) -> int | None:
        """None while alive; -1 once it is gone (code unknown), its leftover ranks killed."""
        if not self._gone and not _alive(self.pid):
            self._gone = True
            # Not our child: another process reaps it, so unlike `ChildProcess.poll` this runs
            # after the pid is free. Pids are not reused within the moment between the two.
            _kill_group(self.pid)
        return -1 if self._gone else None

    def send(self, sig: int) -> None:
        """Signal the process (SIGKILL: its whole group) if it is still alive."""
        if self.poll() is None:
            _signal(self.pid, sig)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited; only its parent can reap it.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


class SubprocessLauncher:
    """Real engine processes via `subprocess.Popen`, each in its own session."""

    def launch(self, argv: list[str], env: dict[str, str], log_path: Path) -> EngineProcess:
        """Start the engine; stdout and stderr go to the (already rotated) log file."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        return ChildProcess(popen)

    def adopt(self, pid: int, marker: str) -> EngineProcess | None:
        """Adopt PID only if it is alive and really our engine (guards against pid reuse)."""
        if not _alive(pid):
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return None
        return AdoptedProcess(pid) if marker in cmdline else None


class HttpProber:
    """Probes engine health endpoints (they need no API key) with a short timeout.

    With TLS (a context trusting the engines' certificate), engines are probed over HTTPS: the
    agent's engines all serve with the certificate the agent gives them, or none do.
    """

    def __init__(self, timeout_s: float = 2.0, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls is not None
        self._client = httpx.Client(timeout=timeout_s, verify=tls or True)

    def __call__(self, host: str, port: int, path: str) -> bool:
        """True on HTTP 200."""
        try:
            return self._client.get(engine_url(host, port, path, self._tls)).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


class HttpMetricsScraper:
    """Reads an engine's Prometheus `/metrics` (which needs no API key) with a short timeout and
    at most LIMIT bytes of body; over HTTPS with TLS, like `HttpProber`.

    TIMEOUT_S bounds each read; DEADLINE_S (default twice TIMEOUT_S) bounds the whole scrape, so
    a listener trickling bytes cannot hold one for long. The deadline is checked between reads,
    so a scrape ends at most one read timeout after it.
    """

    def __init__(
        self,
        timeout_s: float = 2.0,
        tls: ssl.SSLContext | None = None,
        limit: int = METRICS_BODY_LIMIT,
        deadline_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tls = tls is not None
        self._client = httpx.Client(timeout=timeout_s, verify=tls or True)
        self._limit = limit
        self._deadline_s = 2 * timeout_s if deadline_s is None else deadline_s
        self._clock = clock
        # Engines already warned about, and why ("large", "slow"), until a scrape succeeds.
        self._warned: set[tuple[str, int, str]] = set()

    def __call__(self, host: str, port: int, path: str = "/metrics") -> str | None:
        """The exposition text at PATH, or None when the engine does not answer 200, sends a
        body over the limit, or takes longer than the deadline (that scrape is dropped whole;
        the next one tries again)."""
        url = engine_url(host, port, path, self._tls)
        deadline = self._clock() + self._deadline_s
        try:
            # Uncompressed, so the limit bounds what is held, not what a small gzip expands to.
            with self._client.stream("GET", url, headers=_IDENTITY) as response:
                if response.status_code != 200:
                    return None
                announced = response.headers.get("Content-Length", "")
                if announced.isdigit() and int(announced) > self._limit:
                    self._drop(host, port, "large")
                    return None
                body = bytearray()
                for chunk in response.iter_bytes():
                    body += chunk[: self._limit + 1 - len(body)]
                    if len(body) > self._limit:
                        self._drop(host, port, "large")
                        return None
                    if self._clock() > deadline:
                        self._drop(host, port, "slow")
                        return None
                encoding = response.charset_encoding or "utf-8"
        except httpx.HTTPError:
            return None
        self._warned -= {(host, port, "large"), (host, port, "slow")}
        try:
            return body.decode(encoding, errors="replace")
        except LookupError:  # a charset Python does not know
            return body.decode("utf-8", errors="replace")

    def _drop(self, host: str, port: int, why: str) -> None:
        """Drop this scrape; warn once per engine and reason until a scrape succeeds."""
        if (host, port, why) in self._warned:
            return
        self._warned.add((host, port, why))
        if why == "large":
            log.warning(
                "engine %s:%d: /metrics body is over %d bytes; scrapes are dropped until it"
                " is smaller", host, port, self._limit,
            )  # fmt: skip
        else:
            log.warning(
                "engine %s:%d: /metrics took over %.1fs; scrapes are dropped until one is"
                " quicker", host, port, self._deadline_s,
            )  # fmt: skip

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


@dataclass
class PidRecord:
    """What survives an agent restart about one engine: enough to adopt it and keep its port."""

    instance_id: int
    pid: int
    port: int
    config_path: str
    fingerprint: str
    spec: dict[str, Any] = field(default_factory=dict)
    restart_count: int = 0

    def save(self, path: Path) -> None:
        """Write atomically (a torn pid file would make the next agent start a duplicate), 0600.

        The record holds no secret (`InstanceSpec.record()` leaves the API key out), but what an
        engine runs is this user's business only.
        """
        write_private(path, json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> PidRecord | None:
        """Read a pid file; None when it is unreadable (then it is ignored)."""
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None


def rotate_log(path: Path, keep: int) -> None:
    """engine.log -> engine.log.1 -> ... -> engine.log.KEEP (the oldest is dropped)."""
    if not path.exists():
        return
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
    os.replace(path, path.with_name(f"{path.name}.1"))


def truncate_if_large(path: Path, max_bytes: int, keep: int) -> bool:
    """Copy-truncate a log a running engine appends to once it passes MAX_BYTES."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    rotate_target = path.with_name(f"{path.name}.rotating")
    shutil.copyfile(path, rotate_target)
    # The engine holds the file with O_APPEND, so after truncation it writes at the new end.
    with path.open("r+b") as handle:
        handle.truncate(0)
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
    os.replace(rotate_target, path.with_name(f"{path.name}.1"))
    return True


def log_tail(path: Path, lines: int = 5, max_chars: int = 600) -> str:
    """The last lines of a log, for exit reasons a person can act on."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(size - 8192, 0))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])[-max_chars:]


SIGTERM = signal.SIGTERM
SIGKILL = signal.SIGKILL
