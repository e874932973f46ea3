"""The errors of provisioning, in one place; `str()` of each is the message a user acts on.

`connect_error` turns what paramiko raises while connecting into one of them.

ProvisionError
├── HostKeyError     the host key is unknown (and not accepted), changed or revoked
├── ConnectError     unreachable, refused, timed out, or our credentials were not accepted
├── CommandFailed    a remote command exited non-zero (provision.ssh; has `.result`)
└── StepFailed       a step of provisioning could not be done (has `.step`)
InventoryError       a hosts file or flag the user must fix (a ValueError)
"""

from __future__ import annotations

import socket
from pathlib import Path

import paramiko

from provision.target import SshTarget


class ProvisionError(Exception):
    """Base of every provisioning error; str() is the user message."""


class HostKeyError(ProvisionError):
    """The host's key is not known (and not accepted), changed since it was recorded, or revoked."""


class ConnectError(ProvisionError):
    """The host could not be reached or refused our credentials."""


class StepFailed(ProvisionError):
    """A step could not be done; the message says why and what to do."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step


class InventoryError(ValueError):
    """A hosts file or flag the user must fix; the message names the entry and the field."""


def connect_error(
    target: SshTarget, exc: BaseException, key_file: Path | None, timeout_s: float
) -> BaseException:
    """The error that says what to check, for what opening an SSH connection raised (EXC).

    EXC itself when it is ours already, or not a connection failure at all."""
    where = f"{target.host} port {target.port}"
    if isinstance(exc, ProvisionError):
        return exc
    if isinstance(exc, paramiko.PasswordRequiredException):
        return ConnectError(
            f"{target}: the key {key_file} needs a passphrase; pass --ask-password to give it, "
            "or leave out --key to use your SSH agent"
        )
    # "No authentication methods available": paramiko's word when nothing it could try was
    # accepted (a key file it cannot read, an empty agent).
    no_method = "No authentication methods" in str(exc)
    if isinstance(exc, paramiko.AuthenticationException) or no_method:
        how = f"the key {key_file}" if key_file else "your SSH agent and ~/.ssh keys"
        return ConnectError(
            f"{target}: authentication failed with {how}; check --key (or --ask-password) "
            f"and that the public key is in ~{target.user}/.ssh/authorized_keys on the host"
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        return ConnectError(
            f"{target}: connection refused by {where}; check that sshd runs there and "
            "listens on that port (USER@HOST:PORT)"
        )
    if isinstance(exc, socket.gaierror):
        return ConnectError(f"{target}: unknown host {target.host!r} ({exc}); check the name")
    if isinstance(exc, TimeoutError | socket.timeout):
        return ConnectError(
            f"{target}: no answer from {where} within {timeout_s:g} s; "
            "check the address, the port and any firewall between"
        )
    if isinstance(exc, paramiko.SSHException | OSError | EOFError):
        return ConnectError(f"{target}: SSH to {where} failed: {exc}")
    return exc
