"""A real OpenSSH sshd on a free 127.0.0.1 port, with its own host key, for any test.

    server = SshServer(tmp_dir, authorized_keys=[public_key(client_key(tmp_dir))])
    server.start()
    ...  # connect as root@127.0.0.1:server.port; server.known_hosts_line() to trust it
    server.stop()

sshd needs root here (it switches to the user who logs in). Any user in `users` may log in with
an authorized key; a non-root user must exist with a usable shell, and since `UsePAM no` makes
sshd refuse locked accounts, give it a non-locking password field (`usermod -p '*' USER`).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
_START_TIMEOUT_S = 10.0


def sshd_available() -> str | None:
    """None when a real sshd can run here, else the reason a test should skip."""
    if not SSHD.exists():
        return f"{SSHD} is missing: install openssh-server (.ci/run does)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is missing: install openssh-client"
    return None


def client_key(tmp_dir: Path, name: str = "id_ed25519") -> Path:
    """A fresh ed25519 key pair without passphrase in TMP_DIR: the private key's path (the public
    key is next to it, NAME.pub)."""
    path = tmp_dir / name
    _keygen(path)
    return path


def _keygen(path: Path) -> None:
    path.unlink(missing_ok=True)
    public_key(path).unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(path)],
        check=True,
        capture_output=True,
    )


def public_key(private_key: Path) -> Path:
    """The `.pub` file ssh-keygen writes next to PRIVATE_KEY."""
    return private_key.with_name(private_key.name + ".pub")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SshServer:
    """One sshd process: a "host" of the fleet as SSH reaches it, on 127.0.0.1:port."""

    def __init__(
        self,
        state_dir: Path,
        authorized_keys: Iterable[Path] = (),
        *,
        users: Sequence[str] = ("root",),
        port: int | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.users = tuple(users)
        self._port = port or _free_port()
        self._process: subprocess.Popen[bytes] | None = None
        state_dir.mkdir(parents=True, exist_ok=True)
        self.authorized_keys_path = state_dir / "authorized_keys"
        self.authorized_keys_path.write_text("".join(p.read_text() for p in authorized_keys))
        self.host_key_path = state_dir / "ssh_host_ed25519_key"
        if not self.host_key_path.exists():
            _keygen(self.host_key_path)
        self.config_path = state_dir / "sshd_config"
        self.log_path = state_dir / "sshd.log"

    @property
    def port(self) -> int:
        """The TCP port sshd listens on (127.0.0.1 only)."""
        return self._port

    @property
    def host_public_key(self) -> str:
        """The host key as `keytype base64`, without comment."""
        kind, blob = public_key(self.host_key_path).read_text().split()[:2]
        return f"{kind} {blob}"

    def known_hosts_line(self) -> str:
        """The line an OpenSSH known_hosts file has for this server (newline-terminated)."""
        return f"[127.0.0.1]:{self.port} {self.host_public_key}\n"

    def authorize(self, public_key: Path) -> None:
        """Let the holder of PUBLIC_KEY's private key log in (takes effect at once)."""
        with self.authorized_keys_path.open("a") as out:
            out.write(public_key.read_text())

    def log_text(self) -> str:
        """What sshd wrote to stderr so far (LogLevel VERBOSE: connections, auth decisions)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> None:
        """Write the config, check it with `sshd -t`, start sshd and wait until it accepts."""
        if self._process is not None:
            return
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # privilege separation
        self.config_path.write_text(self._config())
        check = subprocess.run(
            [str(SSHD), "-t", "-f", str(self.config_path)], capture_output=True, text=True
        )
        if check.returncode != 0:
            raise RuntimeError(f"sshd -t rejected {self.config_path}:\n{check.stderr}")
        with self.log_path.open("ab") as log:
            # Absolute path: sshd re-executes itself. Its own session: a ^C in the terminal of
            # pytest must not kill it halfway, stop() ends it.
            self._process = subprocess.Popen(
                [str(SSHD), "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        self._wait_until_listening()

    def stop(self) -> None:
        """End sshd (SIGTERM, then SIGKILL); sessions still open end when their client goes."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        # SIGTERM, not SIGINT: sshd started from a background shell may ignore SIGINT.
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)

    def rotate_host_key(self) -> None:
        """Give this server a new ed25519 host key on the same port (a "reinstalled" host)."""
        running = self._process is not None
        self.stop()
        _keygen(self.host_key_path)
        if running:
            self.start()

    def _config(self) -> str:
        keys = self.authorized_keys_path
        return "\n".join(
            [
                "ListenAddress 127.0.0.1",
                f"Port {self.port}",
                f"HostKey {self.host_key_path}",
                f"PidFile {self.state_dir / 'sshd.pid'}",
                f"AuthorizedKeysFile {keys}",
                # A non-root user cannot read KEYS under a 0700 pytest folder: sshd reads
                # authorized keys as the user. Root reads them for it through this command.
                f"AuthorizedKeysCommand /bin/cat {keys}",
                "AuthorizedKeysCommandUser root",
                f"AllowUsers {' '.join(self.users)}",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "Subsystem sftp internal-sftp",
                "LogLevel VERBOSE",
                "",
            ]
        )

    def _wait_until_listening(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._process = None
                raise RuntimeError(f"sshd exited at start:\n{self.log_text()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"sshd did not listen on port {self.port}:\n{self.log_text()}")

    def __enter__(self) -> SshServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"SshServer(port={self.port}, pid={self._process.pid if self._process else None})"


def user_exists(name: str) -> bool:
    """Whether a local account NAME exists (provisioning creates `dctl`; tests remove it only
    when they made it)."""
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
