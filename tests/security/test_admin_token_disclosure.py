"""Threat: the first admin token, printed to stdout on first start, lands wherever stdout goes:
a service manager's journal, a redirected log file, CI output, readable long after by others.

The server now prints it only to a terminal; otherwise it writes it only to the 0600
credentials file and says where. If it can write it nowhere, the token is deleted (never handed
out) and the server stops saying why, so the next start makes a new one.

A real `dctl server` process, with stdout a file, a pseudo-terminal, or unusable credentials.
"""

from __future__ import annotations

import os
import pty
import re
import select
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx

from tests.cli.conftest import DCTL, free_port, isolated_env, start_server, wait_healthy

TOKEN = re.compile(r"dctl_[a-z0-9]{12}_[A-Za-z0-9_\-]{20,128}")


def credentials_of(home: Path) -> Path:
    return home / "config" / "dctl" / "credentials"


def admin_rows(db: Path) -> list[tuple[str, str | None]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT key_id, revoked_at FROM apitoken WHERE role = 'admin'"
        ).fetchall()


def test_the_first_admin_token_never_reaches_a_stdout_that_is_not_a_terminal(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path)
    try:
        output = server.stdout_path.read_text()
        assert TOKEN.search(output) is None
        creds = credentials_of(tmp_path)
        assert f"saved only in {creds} (mode 0600)" in output
        assert creds.stat().st_mode & 0o777 == 0o600
        [secret] = TOKEN.findall(creds.read_text())
        listed = httpx.get(
            f"{server.url}/api/v1/tokens", headers={"Authorization": f"Bearer {secret}"}
        )
        assert listed.status_code == 200  # the saved token is the working admin token
    finally:
        server.stop()
    assert TOKEN.search(server.proc.stderr.read() if server.proc.stderr else "") is None


def test_on_a_terminal_the_first_admin_token_is_shown_once(tmp_path: Path) -> None:
    env = isolated_env(tmp_path)
    port = free_port()
    db = f"sqlite:///{tmp_path / 'dctl.db'}"
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [*DCTL, "server", "--db", db, "--port", str(port), "--migrate"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(terminal)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        shown = b""
        deadline = time.monotonic() + 10
        while b"saved as context" not in shown and time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.2)
            if ready:
                shown += os.read(controller, 4096)
        text = shown.decode()
        assert text.count("admin token (shown only this once): dctl_") == 1, text
        [secret] = TOKEN.findall(text)
        assert secret in credentials_of(tmp_path).read_text()
    finally:
        proc.terminate()
        proc.wait(15)
        os.close(controller)


def test_an_admin_token_that_cannot_be_saved_is_deleted_not_shown(tmp_path: Path) -> None:
    creds = credentials_of(tmp_path)
    creds.parent.mkdir(parents=True)
    creds.write_text('current = "x"\n')
    creds.chmod(0o644)  # refused: a credentials file others can read
    env = isolated_env(tmp_path)
    db_path = tmp_path / "dctl.db"
    argv = [*DCTL, "server", "--db", f"sqlite:///{db_path}", "--port", str(free_port())]
    refused = subprocess.run(
        [*argv, "--migrate"], env=env, capture_output=True, text=True, timeout=60
    )
    assert refused.returncode != 0
    assert TOKEN.search(refused.stdout + refused.stderr) is None
    assert "could not be saved" in refused.stderr and "it was deleted" in refused.stderr
    assert admin_rows(db_path) == []  # no admin token nobody has
    creds.chmod(0o600)
    server = start_server(tmp_path, migrate=False)
    try:
        [(key_id, revoked)] = admin_rows(db_path)
        assert revoked is None and key_id in credentials_of(tmp_path).read_text()
    finally:
        server.stop()
