"""One SSH connection to one host, host key verified, secrets masked in every log line.

Which host keys are trusted is `provision.known_hosts`; the errors are
`provision.errors`, re-exported here. Secrets travel as file contents over SFTP, never on a
command line.
"""

from __future__ import annotations

import logging
import secrets as random_names
import shlex
import shutil
import time
from collections.abc import Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import IO, Any

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut, ThreadException

from provision.errors import ConnectError, HostKeyError, ProvisionError, connect_error
from provision.known_hosts import (
    KnownHosts,
    KnownHostsPolicy,
    changed_key_error,
    fingerprint,
)
from provision.target import SshTarget

__all__ = [
    "CommandFailed",
    "CommandResult",
    "ConnectError",
    "HostKeyError",
    "ProvisionError",
    "Remote",
    "SshOptions",
    "fingerprint",
    "mask",
]

_LOG = logging.getLogger(__name__)
_MASK = "****"
_TIMED_OUT = 124  # the exit code of coreutils' timeout(1), for a command we gave up on
_TAIL_LINES = 20
# Output captured, not echoed; a failing exit is a result, not an exception; no local stdin.
_RUN_OPTIONS: dict[str, Any] = dict(hide=True, warn=True, in_stream=False, pty=False)


@dataclass(frozen=True)
class SshOptions:
    """How to authenticate, and which host keys to trust."""

    key_file: Path | None = None
    password: str | None = None  # from --ask-password; never logged
    known_hosts: Path | None = None  # None: ~/.ssh/known_hosts
    accept_new_host_key: bool = False
    connect_timeout_s: float = 10.0


@dataclass(frozen=True)
class CommandResult:
    """What a remote command did; every text has the secrets masked."""

    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """Whether the command exited 0."""
        return self.exit_code == 0


class CommandFailed(ProvisionError):
    """A remote command exited non-zero; `result` says how."""

    def __init__(self, host: str, result: CommandResult) -> None:
        output = result.stderr.strip() or result.stdout.strip()
        tail = "\n".join(output.splitlines()[-_TAIL_LINES:])
        message = f"{host}: `{result.command}` failed with exit code {result.exit_code}"
        super().__init__(f"{message}:\n{tail}" if tail else message)
        self.result = result


def mask(text: str, secrets: Iterable[str]) -> str:
    """TEXT with every non-empty secret replaced by `****`."""
    # Longest first, so that a secret containing another is masked whole.
    for secret in sorted({s for s in secrets if s}, key=len, reverse=True):
        text = text.replace(secret, _MASK)
    return text


class Remote:
    """One SSH connection to one host (Fabric Connection underneath), host key verified."""

    def __init__(
        self,
        target: SshTarget,
        options: SshOptions,
        *,
        secrets: Sequence[str] = (),
        log: logging.Logger | None = None,
    ) -> None:
        self.target, self.options, self.log = target, options, log or _LOG
        self._secrets = [*secrets, *([options.password] if options.password else [])]
        self._conn: Connection | None = None

    @property
    def known_hosts(self) -> Path:
        """The known-hosts file in use (--known-hosts, else ~/.ssh/known_hosts)."""
        return self.options.known_hosts or Path.home() / ".ssh" / "known_hosts"

    def connect(self) -> None:
        """Open the connection; the host key is checked against the known-hosts file."""
        if self._conn is not None:
            return
        if self.options.key_file and not self.options.key_file.expanduser().is_file():
            raise ConnectError(f"{self.target}: no key file {self.options.key_file}; check --key")
        timeout_s = self.options.connect_timeout_s
        conn = Connection(
            self.target.host,
            user=self.target.user,
            port=self.target.port,
            # An explicit empty ssh_config and lazy=True: no ~/.ssh/config, no fabric.yaml.
            config=Config(ssh_config=paramiko.SSHConfig(), lazy=True),
            connect_kwargs=self._connect_kwargs(),
        )
        known = KnownHosts.read(self.known_hosts, self.log)
        # Into the client's own HostKeys: paramiko writes those back only under AutoAddPolicy.
        known.trust(into=conn.client.get_host_keys(), name=self.target.known_hosts_name)
        accept_new = self.options.accept_new_host_key
        conn.client.set_missing_host_key_policy(
            KnownHostsPolicy(self.target, known, accept_new=accept_new, log=self.log)
        )
        try:
            conn.open()
        except paramiko.BadHostKeyException as exc:
            conn.close()
            refused = known.revoked_error(self.target, exc.key)
            raise refused or changed_key_error(self.target, self.known_hosts, exc) from exc
        except BaseException as exc:
            conn.close()
            error = connect_error(self.target, exc, self.options.key_file, timeout_s)
            if error is exc:
                raise
            raise error from exc
        self._conn = conn

    def add_secret(self, secret: str) -> None:
        """Mask SECRET from now on in every log line and result."""
        self._secrets.append(secret)

    def run(
        self, command: str, *, check: bool = True, timeout_s: float | None = None
    ) -> CommandResult:
        """Run COMMAND with `sh -c` on the host; check=True raises CommandFailed unless it exits 0.

        A command still running after TIMEOUT_S is abandoned with exit code 124."""
        shown = mask(command, self._secrets)
        self.log.info("%s: $ %s", self.target, shown)
        started = time.monotonic()
        # sh -c: POSIX semantics whatever the login shell; stdin from /dev/null: never waits.
        line = f"sh -c {shlex.quote(command)} < /dev/null"
        try:
            done = self._connection().run(line, timeout=timeout_s, encoding="utf-8", **_RUN_OPTIONS)
            exit_code, stdout, stderr = done.exited, done.stdout, done.stderr
            # When invoke's timer wins the race against the channel closing, it returns the
            # channel's "no exit status" (-1) instead of raising CommandTimedOut.
            waited = time.monotonic() - started
            if exit_code == -1 and timeout_s is not None and waited >= timeout_s:
                exit_code, stderr = _TIMED_OUT, f"{stderr}\ntimed out after {timeout_s} s"
        except CommandTimedOut as exc:
            exit_code, stdout = _TIMED_OUT, exc.result.stdout
            stderr = f"{exc.result.stderr}\ntimed out after {timeout_s} s"
        except (ThreadException, paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectError(
                f"{self.target}: connection lost while running `{shown}` ({exc}); "
                "check that the host is up and run again"
            ) from exc
        result = CommandResult(
            shown, exit_code, mask(stdout, self._secrets), mask(stderr, self._secrets)
        )
        elapsed = time.monotonic() - started
        self.log.info("%s: exit %d in %.2f s", self.target, exit_code, elapsed)
        if result.stdout or result.stderr:
            self.log.debug(
                "%s: stdout:\n%s\nstderr:\n%s", self.target, result.stdout, result.stderr
            )
        if check and not result.ok:
            raise CommandFailed(str(self.target), result)
        return result

    def put_bytes(self, data: bytes, remote_path: str, mode: int = 0o644) -> None:
        """Write DATA to REMOTE_PATH with MODE, atomically (a temporary file renamed over it)."""
        self._upload(BytesIO(data), remote_path, mode)

    def put_file(self, local: Path, remote_path: str, mode: int = 0o644) -> None:
        """Copy the local file to REMOTE_PATH with MODE, atomically."""
        with local.open("rb") as source:
            self._upload(source, remote_path, mode)

    def read_text(self, remote_path: str) -> str | None:
        """The text of REMOTE_PATH, or None if it does not exist."""
        try:
            with self._connection().sftp().open(remote_path, "rb") as remote:
                data: bytes = remote.read()
        except FileNotFoundError:
            return None
        except (OSError, paramiko.SSHException) as exc:
            raise ProvisionError(f"{self.target}: cannot read {remote_path}: {exc}") from exc
        return data.decode("utf-8", errors="replace")

    def close(self) -> None:
        """Close the connection (and its SFTP session); safe to call twice."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Remote:
        self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("Remote used before connect()")
        return self._conn

    def _upload(self, source: IO[bytes], remote_path: str, mode: int) -> None:
        sftp = self._connection().sftp()
        temporary = f"{remote_path}.tmp-{random_names.token_hex(6)}"
        try:
            # "x" (O_EXCL): never write through a file or link someone planted at that name.
            with sftp.open(temporary, "wx") as remote:
                # The mode is set while the file is still empty: a secret is never readable
                # by anyone that MODE does not allow, not even for a moment.
                remote.chmod(mode)
                remote.set_pipelined(True)
                shutil.copyfileobj(source, remote, 32768)
            sftp.posix_rename(temporary, remote_path)
        except (OSError, paramiko.SSHException) as exc:
            # Never created, or the connection is gone: then there is nothing to clean up.
            with suppress(OSError, paramiko.SSHException):
                sftp.remove(temporary)
            raise ProvisionError(
                f"{self.target}: cannot write {remote_path}: {exc}; check that its folder "
                f"exists and that {self.target.user} may write there"
            ) from exc

    def _connect_kwargs(self) -> dict[str, Any]:
        timeout = self.options.connect_timeout_s
        kwargs: dict[str, Any] = dict(timeout=timeout, banner_timeout=timeout, auth_timeout=timeout)
        key_file, password = self.options.key_file, self.options.password
        if key_file is None and password is None:
            return kwargs  # paramiko's defaults: the SSH agent, then ~/.ssh/id_*
        # Credentials were named: use exactly those, not whatever the agent holds.
        kwargs.update(allow_agent=False, look_for_keys=False)
        if key_file is not None:
            kwargs["key_filename"] = str(key_file.expanduser())
        if password is not None:
            kwargs["password"] = password
        return kwargs
