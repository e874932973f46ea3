"""Option values that several commands take, parsed one way everywhere."""

from __future__ import annotations

from collections.abc import Iterable

from cli.exits import USAGE, fail
from protocol.labels import parse_labels


def label_option(values: Iterable[str], flag: str = "--label") -> dict[str, str]:
    """A repeated `--label KEY=VALUE` option as a mapping; a malformed item is a usage error."""
    try:
        return parse_labels(values)
    except ValueError as exc:
        fail(f"{flag} {exc}", USAGE)
