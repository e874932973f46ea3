"""Processes as /proc shows them (the ranks below an engine server, whether pids still run),
and stopping one a test started."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any


def _parents() -> dict[int, int]:
    """Every live (not zombie) process and its parent."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # a zombie has exited; its parent just has not reaped it
            parents[int(entry.name)] = int(fields[1])
    return parents


def children(pid: int) -> list[int]:
    """The live children of PID."""
    return [child for child, parent in _parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every live process below PID (its ranks, the fork server that starts them)."""
    found, todo = [], [pid]
    while todo:
        below = children(todo.pop())
        found += below
        todo += below
    return found


def alive(pids: list[int]) -> list[int]:
    """Those of PIDS that still run."""
    return [pid for pid in pids if pid in _parents()]


def worker_ranks(pid: int) -> list[int]:
    """The ranks other than rank 0 (the server process PID): the children of its fork server
    (its other children, the fork server and multiprocessing's resource tracker, have none)."""
    return [rank for child in children(pid) for rank in children(child)]


def stop(process: subprocess.Popen[Any], timeout_s: float = 20.0) -> None:
    """SIGTERM a process a test started (by its pid), SIGKILL it after TIMEOUT_S, and reap it."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
