"""Exit codes of every `dctl` command, and the errors that map onto them."""

from __future__ import annotations

import sys
from typing import NoReturn

import typer

OK = 0
FAILURE = 1
USAGE = 2
NOT_AVAILABLE = 3


class CliError(Exception):
    """A failure the user can act on; printed as one line, exit code 1 (or the given code)."""

    def __init__(self, message: str, code: int = FAILURE) -> None:
        super().__init__(message)
        self.code = code


def not_available(command: str) -> NoReturn:
    """Refuse a command that a later release implements: no fake output, exit 3."""
    print(f"dctl {command}: not available yet", file=sys.stderr)
    raise typer.Exit(NOT_AVAILABLE)


def fail(message: str, code: int = FAILURE) -> NoReturn:
    """Print one error line to stderr and exit."""
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)
