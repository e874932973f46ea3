"""Option values that several commands take, parsed one way everywhere."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cli.exits import USAGE, fail
from protocol.labels import parse_labels


def label_option(values: Iterable[str], flag: str = "--label") -> dict[str, str]:
    """A repeated `--label KEY=VALUE` option as a mapping; a malformed item is a usage error."""
    try:
        return parse_labels(values)
    except ValueError as exc:
        fail(f"{flag} {exc}", USAGE)


def duration_option(text: str, flag: str) -> int:
    """`90s`, `30m`, `24h`, `7d` -> seconds; anything else is a usage error naming FLAG."""
    from runtime.durations import parse_duration

    value = parse_duration(text)
    if value is None:
        fail(f"{flag} {text!r}: write a positive duration like 30m, 24h or 7d", USAGE)
    return value


def percent_option(text: str, flag: str) -> int:
    """`10%` or `10` -> 10. Only the form is checked: the request model holds the range."""
    value = text.strip().removesuffix("%")
    if not value.isdigit():
        fail(f"{flag} {text!r}: write a whole percent, e.g. 10%", USAGE)
    return int(value)


def percents_option(text: str, flag: str) -> list[int]:
    """`10,25%,100` -> [10, 25, 100]. Only the form is checked: the request model holds the
    rules (rising, ending at 100)."""
    items = [item.strip().removesuffix("%") for item in text.split(",")]
    if not all(item.isdigit() for item in items):
        fail(f"{flag} {text!r}: write rising percents ending at 100, e.g. 10,25,50,100", USAGE)
    return [int(item) for item in items]


def mapping_file_option(path: Path, flag: str) -> dict[str, Any]:
    """A YAML or JSON file holding a mapping; errors name FLAG, the file and what is wrong."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        fail(f"{flag} {path}: cannot be read: {exc.strerror or exc}", USAGE)
    except yaml.YAMLError as exc:
        fail(f"{flag} {path}: not valid YAML/JSON: {str(exc).splitlines()[0]}", USAGE)
    if data is None:
        return {}
    if not isinstance(data, dict):
        fail(f"{flag} {path}: must hold a mapping of settings, not a list or value", USAGE)
    return data


def engine_config_option(path: Path) -> dict[str, Any]:
    """An `--engine-config` file (YAML or JSON), whole; the request model checks its sections."""
    return mapping_file_option(path, "--engine-config")
