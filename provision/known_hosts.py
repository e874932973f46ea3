"""Which host keys to trust: the OpenSSH known-hosts file, read and appended the way ssh does.

Fabric and paramiko accept any host key unless told otherwise. Here a key must already be in
the file, or be new and explicitly accepted (`--accept-new-host-key`, then it is recorded so
the next run needs no flag). A changed key is always refused.

paramiko's own loader skips marker lines, so they are read here, as ssh reads them: a key on a
`@revoked` line is refused for the hosts the line names, whether it is known, new or changed,
and never recorded. A host that the file trusts through `@cert-authority` (and knows no key of)
is refused: paramiko cannot check host certificates, and recording the plain key the host also
offers would trust what the file's owner chose to trust only through the CA.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko
from paramiko.hostkeys import HostKeyEntry, InvalidHostKey

from provision.errors import HostKeyError
from provision.target import SshTarget

REVOKED = "@revoked"
CERT_AUTHORITY = "@cert-authority"


def fingerprint(key: paramiko.PKey) -> str:
    """The key's fingerprint as `ssh-keygen -lf` prints it: `SHA256:<base64, no padding>`."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def names_host(patterns: Sequence[str], name: str) -> bool:
    """Whether a line's host field (PATTERNS, split at commas) names the host NAME, as OpenSSH
    decides: `*` and `?` are wildcards, a matching `!pattern` vetoes the line, a hashed entry
    (`|1|salt|hash`) is NAME's HMAC, case does not matter."""
    name = name.lower()
    named = False
    for pattern in patterns:
        if pattern.startswith("|1|"):
            salt = pattern.split("|")[2] if pattern.count("|") == 3 else ""
            named = named or (bool(salt) and paramiko.HostKeys.hash_host(name, salt) == pattern)
            continue
        negated = pattern.startswith("!")
        wanted = "".join(
            ".*" if c == "*" else "." if c == "?" else re.escape(c)
            for c in pattern.removeprefix("!").lower()
        )
        if re.fullmatch(wanted, name):
            if negated:
                return False
            named = True
    return named


@dataclass(frozen=True)
class MarkedKey:
    """A key on a `@revoked` or `@cert-authority` line, with the hosts the line names."""

    patterns: tuple[str, ...]
    key: paramiko.PKey
    line: int


@dataclass
class KnownHosts:
    """The known-hosts file as ssh reads it: host keys, revoked keys and trusted CAs."""

    path: Path
    keys: list[HostKeyEntry] = field(default_factory=list)
    revoked: list[MarkedKey] = field(default_factory=list)
    authorities: list[MarkedKey] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path, log: logging.Logger) -> KnownHosts:
        """The file at PATH (none: nothing known); lines we cannot read are skipped."""
        # Not HostKeys.load: one corrupt line there (bad base64) fails every connection.
        known = cls(path)
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return known
        except OSError as exc:
            raise HostKeyError(
                f"cannot read the known-hosts file: {exc}; check --known-hosts"
            ) from exc
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            marker, rest = line.split(None, 1) if line.startswith("@") else ("", line)
            try:
                entry = HostKeyEntry.from_line(rest, number) if rest else None
            except (paramiko.SSHException, InvalidHostKey, ValueError):
                entry = None
            if entry is None or marker not in ("", REVOKED, CERT_AUTHORITY):
                log.debug("%s:%d: skipped a line that is not a host key we can read", path, number)
                continue
            if marker:
                marked = MarkedKey(tuple(entry.hostnames), entry.key, number)
                (known.revoked if marker == REVOKED else known.authorities).append(marked)
            else:
                known.keys.append(entry)
        return known

    def revocation(self, name: str, key: paramiko.PKey) -> int | None:
        """The line that revokes KEY for the host NAME, if one does."""
        for marked in self.revoked:
            if marked.key.asbytes() == key.asbytes() and names_host(marked.patterns, name):
                return marked.line
        return None

    def trust(self, into: paramiko.HostKeys, name: str) -> None:
        """Add the host keys to INTO, less those revoked for NAME (so paramiko never accepts
        one: it asks the policy, or finds the key changed, and both check revocation)."""
        for entry in self.keys:
            if self.revocation(name, entry.key) is not None:
                continue
            for host in entry.hostnames:  # plain or hashed (|1|...): HostKeys matches both
                into.add(host, entry.key.get_name(), entry.key)

    def revoked_error(self, target: SshTarget, key: paramiko.PKey) -> HostKeyError | None:
        """The refusal of KEY, if the file revokes it for TARGET."""
        line = self.revocation(target.known_hosts_name, key)
        if line is None:
            return None
        return HostKeyError(
            f"{target}: REVOKED HOST KEY: the host presents {key.get_name()} {fingerprint(key)}, "
            f"which {self.path} revokes (line {line}, @revoked). The host may be compromised "
            "or impersonated: do not provision it until its administrator gives it a new key; "
            "then record that one in the file."
        )

    def authority_error(self, target: SshTarget) -> HostKeyError | None:
        """The refusal of a host known only through a certificate authority, if TARGET is one."""
        name = target.known_hosts_name
        lines = [m.line for m in self.authorities if names_host(m.patterns, name)]
        if not lines:
            return None
        return HostKeyError(
            f"{target}: {self.path} trusts this host through a certificate authority (line "
            f"{lines[0]}, @cert-authority), and dctl cannot check host certificates. Add the "
            "host's own key to the file (check it on the host: `ssh-keygen -lf "
            "/etc/ssh/ssh_host_ed25519_key.pub`), or pass --known-hosts with a file that has it."
        )


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
        self, target: SshTarget, known: KnownHosts, *, accept_new: bool, log: logging.Logger
    ) -> None:
        self.target, self.known, self.accept_new, self.log = target, known, accept_new, log
        self.path = known.path

    def missing_host_key(self, client: Any, hostname: str, key: paramiko.PKey) -> None:
        """Refuse the key (HostKeyError), or record it when the user said so."""
        known = self.known
        refused = known.revoked_error(self.target, key) or known.authority_error(self.target)
        if refused is not None:
            raise refused
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
