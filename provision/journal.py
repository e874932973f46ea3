"""What this run changed on a host, so that a failure undoes exactly that and nothing more."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from provision.ssh import CommandResult


class Runs(Protocol):
    """Anything that runs a remote command (a `Remote`, or the dry run's recorder)."""

    def run(
        self, command: str, *, check: bool = True, timeout_s: float | None = None
    ) -> CommandResult: ...


@dataclass
class Journal:
    """Undo commands in the order their changes were made; `rollback` runs them backwards."""

    entries: list[tuple[str, str]] = field(default_factory=list)

    def record(self, what: str, undo: str) -> None:
        """Remember how to undo WHAT (a shell command run with the same privileges)."""
        self.entries.append((what, undo))

    def rollback(self, remote: Runs, log: logging.Logger) -> list[str]:
        """Undo everything, newest first; returns what could not be undone (never raises)."""
        left: list[str] = []
        for what, undo in reversed(self.entries):
            try:
                result = remote.run(undo, check=False)
            except Exception as exc:  # a dead connection must not hide the original failure
                log.warning("undo %s failed: %s", what, exc)
                left.append(what)
                continue
            if not result.ok:
                log.warning("undo %s failed: %s", what, result.stderr.strip())
                left.append(what)
        self.entries.clear()
        return left
