"""The demo's child processes: started so that they cannot outlive `dctl up`, stopped with a
bounded wait.

Each child runs in a session of its own, so a Ctrl-C (or the hang-up of a closing terminal)
reaches only `dctl up`, which then stops them in its own order. On Linux each also gets a
parent-death signal: should `dctl up` itself be SIGKILLed, its children get SIGTERM and shut down
as usual, the agent with its engines (`--stop-engines-on-exit`).

Engines are the agent's children, in sessions of their own: by design they outlive an agent that
exits (a restarted agent adopts them). The agent's pid files name the ones it did not stop, so
`stop_leftover_engines` can end them once the agent is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from cli.exits import CliError
from runtime.parent_death import die_with_parent


class Children:
    """The demo's processes by name, each logging to LOG_DIR/NAME.log."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def log_path(self, name: str) -> Path:
        """Where NAME's output goes."""
        return self.log_dir / f"{name}.log"

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        """Start NAME in a session of its own, its output appended to its log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path(name).open("ab")
        self._logs.append(log)
        self.processes[name] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True, preexec_fn=die_with_parent(),
        )  # fmt: skip

    def check(self) -> None:
        """Raise `CliError` naming the first child that has exited and its log."""
        for name, child in self.processes.items():
            code = child.poll()
            if code is not None:
                raise CliError(f"the {name} exited with code {code}; see {self.log_path(name)}")

    def stop(self, name: str, grace_s: float) -> None:
        """SIGTERM NAME and wait up to GRACE_S; then SIGKILL its whole process group."""
        child = self.processes.get(name)
        if child is None:
            return
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            # Unreaped, its pid (the group's id) cannot have been reused yet.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()

    def close_logs(self) -> None:
        """Close this process's handles on the children's logs."""
        for log in self._logs:
            log.close()
        self._logs.clear()


def stop_leftover_engines(run_dir: Path, grace_s: float) -> list[int]:
    """SIGTERM every engine the agent's pid files in RUN_DIR still name, SIGKILL those alive
    after GRACE_S; returns their pids.

    Called once the agent is gone: an agent that stopped its engines removed their pid files, so
    what is left was not stopped (the agent crashed, or was killed for overstaying its grace).
    """
    from agent.engine_process import PidRecord, SubprocessLauncher

    launcher = SubprocessLauncher()
    engines = []
    for pid_file in sorted(run_dir.glob("instance-*.json")):
        record = PidRecord.load(pid_file)
        # adopt() checks the command line, so a reused pid is never signalled.
        engine = launcher.adopt(record.pid, record.config_path) if record else None
        if engine is not None:
            engine.send(signal.SIGTERM)
            engines.append(engine)
    deadline = time.monotonic() + grace_s
    while any(e.poll() is None for e in engines) and time.monotonic() < deadline:
        time.sleep(0.2)
    for engine in engines:
        engine.send(signal.SIGKILL)
    return [e.pid for e in engines]
