"""The agent's exception hierarchy, written out in one place.

Settings the agent cannot use raise `agent.settings.SettingsError` (the bottom layer's) and the
GPU backends `agent.gpu.GpuError`; everything else that goes wrong is one of these, each with a
message that says what to do next.
"""

from __future__ import annotations


class AgentFailure(Exception):
    """The agent cannot start or go on running (root without --allow-root, a port in use, the
    control plane refusing it); the process exits 1 with the message."""


# The control plane, as the agent's link meets it.


class ControlPlaneUnavailable(Exception):
    """The control plane cannot be reached or answered 5xx: keep serving, try again later."""


class ControlPlaneRejected(Exception):
    """The control plane refused the request (4xx); the message carries its reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class UnusableIdentity(Exception):
    """The saved identity may not be used: issued by another control plane, or its files are not
    the agent's own plain files. The message says which files to remove to register again."""


class ForeignUrl(ValueError):
    """A URL the control plane sent is not on the control plane: the agent token never goes
    there."""


# Weight snapshots.


class SnapshotError(Exception):
    """A snapshot cannot be fetched or used; the message says which file and what to do."""


class SnapshotMismatch(SnapshotError):
    """A file's size or sha256 differs from the manifest: the source is corrupt or was changed."""

    def __init__(self, digest: str, path: str, expected: str, actual: str) -> None:
        super().__init__(
            f"snapshot {digest[:12]}: file {path} does not match the manifest "
            f"(expected {expected}, got {actual}); the source is corrupt or was modified after "
            "registration - fix the source or register a new version"
        )
        self.path = path


class TransferRefused(SnapshotError):
    """The file server answered what the agent cannot use (an error status, a wrong range).

    Only the file in flight is dropped; other files' partial data stays for the next attempt.
    """


class FetchCancelled(SnapshotError):
    """The agent is shutting down; the partial data is kept so the next fetch resumes."""


# The agent's own files.


class PrivateFileError(OSError):
    """A private file or directory is not what it must be (a symlink, not ours); says what to do."""
