"""What an operator's terminal receives from `dctl`: the hostile strings an agent would send,
a control plane whose database already holds them (rows stored before the API refused them),
`dctl` run in a pseudo-terminal, and the check that none of them reaches the terminal as an
instruction."""

from __future__ import annotations

import fcntl
import hashlib
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import sqlmodel
from sqlmodel import Session, col

from controlplane import migrate
from controlplane.models import Event, Host, Instance
from tests.security.live_controlplane import LiveControlPlane, serve

# What the review planted, one of each kind.
OSC_TITLE = "\x1b]0;pwned\x07"  # sets the terminal's (tmux pane's) title
ERASE_LINE = "\x1b[1A\x1b[2K"  # cursor up, erase the line: hides what was printed above
OSC_LINK = "\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\"  # a hyperlink the text does not show
MARKUP = "[bold red]x[/]"  # rich markup: styled cells
MARKUP_LINK = "[link=http://evil]y[/link]"  # rich markup: a hyperlink
C1_CSI = "\x9b2J"  # the one-byte CSI: clear the screen
# The markup first: after the link's final backslash rich would read `[` as escaped.
HOSTILE = MARKUP + OSC_TITLE + ERASE_LINE + OSC_LINK + C1_CSI + MARKUP_LINK  # 91 characters
SHORT = OSC_TITLE + ERASE_LINE + C1_CSI + "v1"  # for fields of 32 characters at most
HOST = "gpu-1"

V = "/api/v1"
# rich's own colours and bold: the only escape sequences a plain command prints.
_SGR = re.compile(rb"\x1b\[[0-9;]*m")


def assert_inert(screen: bytes, *, full_screen: bool = False) -> None:
    """SCREEN (the bytes a terminal got) carries none of the hostile strings' instructions, and
    shows the markup as the text it is.

    A plain command prints no escape sequence but rich's colours; a full-screen app (the TUI)
    moves the cursor itself, so there only the attacker's own sequences are looked for.
    """
    assert b"pwned" not in screen, "an OSC title (or its text) reached the terminal"
    assert ERASE_LINE.encode() not in screen, "cursor-up + erase-line reached the terminal"
    assert b"\x1b]8;" not in screen, "a hyperlink (OSC 8) reached the terminal"
    assert "\x9b".encode() not in screen, "a C1 CSI reached the terminal"
    # The markup is shown as text, so the only `http://evil` is inside it.
    assert MARKUP.encode() in screen, "the markup was read as markup, not shown as text"
    assert MARKUP_LINK.encode() in screen, "the link markup was read as markup"
    assert b"http://evil" not in screen.replace(MARKUP_LINK.encode(), b"")
    if not full_screen:
        assert b"\x1b" not in _SGR.sub(b"", screen), "an escape sequence reached the terminal"


# --- a control plane with hostile rows -------------------------------------------------------


def _setup(live: LiveControlPlane, weights: Path) -> None:
    """A host with a GPU, a deployment with an instance on it: clean, through the API."""
    boot = live.token("bootstrap")
    registered = live.call(
        "POST", f"{V}/agents/register", boot, json={"name": HOST, "labels": {"zone": "a"}}
    )
    assert registered.status_code == 200, registered.text
    agent = registered.json()["agent_token"]
    gpu = {"index": 0, "uuid": "GPU-0", "name": "H100", "memory_total_bytes": 80 << 30}
    assert live.heartbeat(agent, gpus=[gpu]).status_code == 200
    data = b"weights"
    (weights / "model.safetensors").write_bytes(data)
    files = [{"path": "model.safetensors", "size": len(data),
              "sha256": hashlib.sha256(data).hexdigest()}]  # fmt: skip
    body = {"version": "v1", "manifest": {"files": files}, "source_uri": str(weights)}
    assert live.call("POST", f"{V}/models/demo/versions", live.admin, json=body).status_code == 201
    body = {"name": "web", "model": "demo", "version": "v1", "placement": {"hosts": [HOST]}}
    assert live.call("POST", f"{V}/deployments", live.admin, json=body).status_code == 201


def plant(live: LiveControlPlane) -> None:
    """HOSTILE (SHORT where it would not fit) in every agent-controlled field of HOST's rows,
    written straight into the database: old rows the API's validation never saw."""
    check = {"name": SHORT, "status": "fail", "reason": HOSTILE}
    gpu = {"index": 0, "uuid": HOSTILE, "name": HOSTILE, "memory_total_bytes": 80 << 30,
           "memory_used_bytes": 0}  # fmt: skip
    with Session(live.engine) as session:
        host = session.exec(sqlmodel.select(Host).where(col(Host.name) == HOST)).one()
        host.labels = {"zone": HOSTILE}
        host.facts = {"hostname": HOSTILE, "os": HOSTILE, "agent_version": SHORT,
                      "driver_version": SHORT, "cuda_driver_version": SHORT,
                      "gpu_backend": "fake", "preflight": [check]}  # fmt: skip
        host.gpu_samples = [gpu]
        for instance in session.exec(sqlmodel.select(Instance)).all():
            instance.message = HOSTILE
            instance.observed_state = "failed"
            instance.last_exit = {"code": 1, "reason": HOSTILE}
        event = Event(time=datetime.now(UTC), actor=HOSTILE, kind="instance.failed",
                      subject=HOSTILE, message=HOSTILE)  # fmt: skip
        session.add(event)
        session.commit()


@contextmanager
def planted_plane(tmp: Path) -> Iterator[LiveControlPlane]:
    """A control plane on loopback whose SQLite database holds HOSTILE in HOST's rows."""
    url = f"sqlite:///{tmp / 'dctl.db'}"
    migrate.upgrade(url)
    weights = tmp / "weights"
    weights.mkdir()
    with contextmanager(serve)(url) as live:
        _setup(live, weights)
        plant(live)
        yield live


def dctl_env(live: LiveControlPlane, home: Path) -> dict[str, str]:
    """The environment of a `dctl` talking to LIVE as its admin, config under HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCTL_")}
    env.update(
        XDG_CONFIG_HOME=str(home / "config"),
        XDG_DATA_HOME=str(home / "data"),
        DCTL_URL=live.url,
        DCTL_TOKEN=live.admin,
        TERM="xterm-256color",
        COLUMNS="",
        LINES="",
    )
    return {k: v for k, v in env.items() if v}


# --- a pseudo-terminal ------------------------------------------------------------------------


class Terminal:
    """`dctl ARGS` on the slave side of a pty of COLUMNS x ROWS; every byte it writes kept."""

    def __init__(
        self, args: Sequence[str], env: dict[str, str], columns: int = 240, rows: int = 50
    ) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.master = master
        self.output = b""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
        )
        os.close(slave)

    def _read(self, timeout_s: float) -> bool:
        """Read what is there within TIMEOUT_S; False once the other side closed."""
        ready, _, _ = select.select([self.master], [], [], timeout_s)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the program exited and closed the slave
            return False
        self.output += chunk
        return bool(chunk)

    def send(self, keys: str) -> int:
        """Type KEYS; where the output stood (for `wait_for`)."""
        mark = len(self.output)
        os.write(self.master, keys.encode())
        return mark

    def wait_for(self, text: bytes, since: int = 0, timeout_s: float = 30.0) -> None:
        """Read until TEXT has been written after offset SINCE of the output, or fail."""
        deadline = time.monotonic() + timeout_s
        while text not in self.output[since:]:
            assert time.monotonic() < deadline, f"{text!r} never shown: {self.output[-2000:]!r}"
            if not self._read(0.1):
                raise AssertionError(f"exited before showing {text!r}: {self.output[-2000:]!r}")

    def finish(self, timeout_s: float = 30.0) -> bytes:
        """Read until the program exits; everything it wrote."""
        deadline = time.monotonic() + timeout_s
        while self._read(0.1):
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"still running after {timeout_s} s: {self.output[-2000:]!r}")
        self.proc.wait(timeout_s)
        os.close(self.master)
        return self.output


def run_in_terminal(args: Sequence[str], env: dict[str, str]) -> tuple[int, bytes]:
    """`dctl ARGS` in a pty until it exits: its exit code and what the terminal received."""
    terminal = Terminal(args, env)
    screen = terminal.finish()
    return terminal.proc.returncode, screen
