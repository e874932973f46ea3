"""Test doubles for the supervisor: processes, launcher and health probes (the clock is
`tests.clock.FakeClock`)."""

from __future__ import annotations

import signal
from pathlib import Path


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.code: int | None = None
        self.signals: list[int] = []
        self.exit_on_term = True

    def poll(self) -> int | None:
        return self.code

    def send(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGKILL or (sig == signal.SIGTERM and self.exit_on_term):
            self.code = -sig


class FakeLauncher:
    def __init__(self) -> None:
        self.launched: list[tuple[list[str], dict[str, str], FakeProcess]] = []
        self.alive: dict[int, FakeProcess] = {}

    def launch(self, argv: list[str], env: dict[str, str], log_path: Path) -> FakeProcess:
        proc = FakeProcess(1000 + len(self.launched))
        self.launched.append((argv, env, proc))
        self.alive[proc.pid] = proc
        return proc

    def adopt(self, pid: int, marker: str) -> FakeProcess | None:
        return self.alive.get(pid)

    @property
    def last(self) -> FakeProcess:
        return self.launched[-1][2]


class Health:
    def __init__(self) -> None:
        self.ready = False
        self.live = True
        self.calls: list[tuple[str, int, str]] = []

    def __call__(self, host: str, port: int, path: str) -> bool:
        self.calls.append((host, port, path))
        return self.ready if path == "/health/ready" else self.live
