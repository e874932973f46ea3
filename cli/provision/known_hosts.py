"""Which host keys to trust: the OpenSSH known-hosts file, read and appended the way ssh does.

Fabric and paramiko accept any host key unless told otherwise. Here a key must already be in
the file, or be new and explicitly accepted (`--accept-new-host-key`, then it is recorded so
the next run needs no flag). A changed key is always refused.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shlex
from pathlib import Path
from typing import Any

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

from cli.provision.errors import HostKeyError
from cli.provision.target import SshTarget


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as `ssh-keygen -lf` prints it: `SHA256:<base64, no padding>`."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def load_known_hosts(path: Path, into: paramiko.HostKeys, log: logging.Logger) -> None:
    """Add the keys of the known-hosts file at PATH (if any); lines we cannot read are skipped."""
    # Not HostKeys.load: one corrupt line there (bad base64) fails every connection.
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise HostKeyError(f"cannot read the known-hosts file: {exc}; check --known-hosts") from exc
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        # Markers (@cert-authority, @revoked) are not supported: such lines are skipped.
        if not line or line.startswith(("#", "@")):
            continue
        try:
            entry = HostKeyEntry.from_line(line, number)
        except (paramiko.SSHException, InvalidHostKey, ValueError):
            entry = None
        if entry is None:
            log.debug("%s:%d: skipped a line that is not a host key we can read", path, number)
            continue
        for name in entry.hostnames:  # plain or hashed (|1|...): HostKeys matches both
            into.add(name, entry.key.get_name(), entry.key)


def record_known_host(path: Path, name: str, key: paramiko.PKey) -> None:
    """Append `NAME KEYTYPE BASE64` to the file, creating it 0600 (its folder 0700) if missing."""
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            line = "\n" + line
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "ab") as out:
            out.write(line.encode())  # one write: parallel runs appending never interleave
    except OSError as exc:
        raise HostKeyError(
            f"cannot record the host key of {name}: {exc}; pass --known-hosts FILE you may write"
        ) from exc


def changed_key_error(
    target: SshTarget, path: Path, error: paramiko.BadHostKeyException
) -> HostKeyError:
    """The error for a host whose key differs from the one PATH records: never accepted."""
    seen, known = error.key, error.expected_key
    return HostKeyError(
        f"{target}: HOST KEY CHANGED: the host presents {seen.get_name()} {fingerprint(seen)}, "
        f"but {path} records {known.get_name()} {fingerprint(known)}. Someone may be "
        "intercepting the connection, or the host was reinstalled. If you know the key changed, "
        f"remove the old one with `ssh-keygen -R {shlex.quote(target.known_hosts_name)} "
        f"-f {path}` and run again with --accept-new-host-key."
    )


class KnownHostsPolicy(paramiko.MissingHostKeyPolicy):
    """What paramiko does with a host whose name is not in the known-hosts file at all."""

    def __init__(
        self, target: SshTarget, path: Path, *, accept_new: bool, log: logging.Logger
    ) -> None:
        self.target, self.path, self.accept_new, self.log = target, path, accept_new, log

    def missing_host_key(self, client: Any, hostname: str, key: paramiko.PKey) -> None:
        """Refuse the key (HostKeyError), or record it when the user said so."""
        seen = f"{key.get_name()} {fingerprint(key)}"
        if not self.accept_new:
            raise HostKeyError(
                f"{self.target}: host key {seen} is not in {self.path}. Check it with the "
                "host's administrator (on the host: `ssh-keygen -lf /etc/ssh/ssh_host_*.pub`), "
                "then run again with --accept-new-host-key to trust it and record it there."
            )
        # HOSTNAME is paramiko's lookup name: `host`, or `[host]:port` off port 22.
        record_known_host(self.path, hostname, key)
        self.log.warning("%s: recorded new host key %s in %s", self.target, seen, self.path)
