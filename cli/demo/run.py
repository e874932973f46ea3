"""The demo's entry module: settings in; start, print, serve until a signal, stop; exit code out.

Stopping must not depend on the terminal. With `dctl up --demo | tee up.log`, Ctrl-C kills `tee`
too, so the demo's next line meets a broken pipe; closing the terminal hangs the demo up and
makes its terminal unwritable. So SIGINT, SIGTERM and SIGHUP all mean "stop", and a line that
cannot be written sends the rest of that stream to /dev/null (`Console`) instead of aborting the
stop. `DemoStack.stop` runs on every way out of `run`; should this process be SIGKILLed, its
children still get SIGTERM (`cli.demo.children`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from cli.demo.traffic import DEFAULT_RPS
from cli.exits import CliError

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class DemoSettings:
    """What `dctl up --demo` was asked for."""

    data_dir: Path
    port: int  # the control plane's
    size: str | None = None  # None: the trained demo model; tiny | small: random weights
    timeout_s: float = 600.0  # for the engines to become ready
    traffic_rps: float = DEFAULT_RPS  # 0: no demo traffic


class Console:
    """The demo's lines on stdout and its errors on stderr, for as long as anyone reads them.

    A write that fails (EPIPE: the reader is gone; EIO: the terminal hung up; a closed file)
    points that stream's descriptor at /dev/null: the lines after it, and Python's flush at exit,
    then go nowhere instead of raising again.
    """

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def say(self, line: str) -> None:
        """Print LINE on stdout."""
        _write(self.out, line)

    def error(self, line: str) -> None:
        """Print LINE on stderr."""
        _write(self.err, line)


def _write(stream: TextIO, line: str) -> None:
    try:
        print(line, file=stream, flush=True)
    except (OSError, ValueError):  # ValueError: the stream is closed
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
            stream.flush()  # what the failed flush kept goes to /dev/null now
        except (OSError, ValueError):
            pass  # closed for good: nothing more reaches it


def run(settings: DemoSettings, console: Console | None = None) -> int:
    """Run the demo until SIGINT, SIGTERM or SIGHUP (this process's handlers); the exit code:
    0 once stopped, 128 + the signal's number when interrupted during start-up."""
    from cli.demo.stack import DemoStack
    from cli.demo.summary import demo_summary

    console = console or Console()
    stop = threading.Event()
    received: list[int] = []
    starting = True

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal starting
        received.append(signum)
        stop.set()
        if starting:
            starting = False  # only once: a second signal must not abort the clean-up too
            raise KeyboardInterrupt  # abandon start-up wherever it is; `finally` stops the rest

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)
    stack = DemoStack(settings.data_dir, settings.port, settings.size, settings.timeout_s,
                      say=console.say, traffic_rps=settings.traffic_rps)  # fmt: skip
    try:
        try:
            endpoints = stack.start()
        finally:
            starting = False  # from here on a signal only sets `stop`
        console.say(demo_summary(endpoints, settings.size, settings.traffic_rps))
        stack.watch(stop)
        console.say("stopping the demo...")
        return 0
    except CliError as exc:
        console.error(f"error: {exc}")
        return exc.code
    except KeyboardInterrupt:
        console.say("interrupted during start-up; stopping what was started")
        return 128 + received[0] if received else 130
    finally:
        stack.stop()
