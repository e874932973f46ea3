"""The front of a command engine as a real process: its drain signal, its exit status, and an
engine that never outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.processes import alive, children

# An engine that reports each signal it gets to a file, then exits 0 on SIGINT (its drain).
ENGINE = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def got(sig, _):
    out.write_text(out.read_text() + signal.Signals(sig).name + "\\n")
    if sig == signal.SIGINT:
        sys.exit(0)
signal.signal(signal.SIGINT, got)
signal.signal(signal.SIGTERM, got)
out.write_text("started\\n")
while True:
    time.sleep(0.05)
"""


def start_front(tmp_path: Path, drain: str = "SIGINT") -> tuple[subprocess.Popen[bytes], Path]:
    report = tmp_path / "signals.txt"
    config = tmp_path / "instance-1.yaml"
    config.write_text(yaml.safe_dump({"argv": [sys.executable, "-c", ENGINE, str(report)],
                                      "drain_signal": drain, "env": {}}))  # fmt: skip
    front = subprocess.Popen(
        [sys.executable, "-m", "agent.backends.fronted", "--config", str(config)],
        start_new_session=True,
    )
    wait_for(lambda: report.exists() and "started" in report.read_text())
    return front, report


def wait_for(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_sigterm_reaches_the_engine_as_its_drain_signal_once(tmp_path: Path) -> None:
    front, report = start_front(tmp_path, drain="SIGINT")
    front.send_signal(signal.SIGTERM)
    front.send_signal(signal.SIGTERM)  # repeated: must not cut the drain short
    assert front.wait(timeout=20) == 0
    assert report.read_text().split() == ["started", "SIGINT"]


def test_the_engine_does_not_outlive_a_killed_front(tmp_path: Path) -> None:
    front, _ = start_front(tmp_path)
    (engine,) = children(front.pid)
    os.kill(front.pid, signal.SIGKILL)  # the front alone, not its group
    front.wait(timeout=10)
    wait_for(lambda: not alive([engine]))


def test_the_front_exits_with_the_engines_status(tmp_path: Path) -> None:
    config = tmp_path / "instance-2.yaml"
    config.write_text(yaml.safe_dump({"argv": [sys.executable, "-c", "raise SystemExit(3)"]}))
    done = subprocess.run(
        [sys.executable, "-m", "agent.backends.fronted", "--config", str(config)], timeout=30
    )
    assert done.returncode == 3
