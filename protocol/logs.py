"""Structured logging (JSON or key=value) with secrets redacted before anything is written."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

# Token secrets look like dctl_<id>_<random>; bearer headers and api keys may appear in messages.
_SECRET_PATTERNS = [
    re.compile(r"dctl_[A-Za-z0-9]+_[A-Za-z0-9_\-]+"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._\-]+"),
]
_SECRET_KEYS = {"token", "secret", "password", "api_key", "authorization", "bootstrap_token"}
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def redact(text: str) -> str:
    """Replace anything that looks like a secret with `***`."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + "***", text)
    return text


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z",
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": redact(record.getMessage()),
    }
    for key, value in vars(record).items():
        if key in _RESERVED or key.startswith("_"):
            continue
        fields[key] = "***" if key.lower() in _SECRET_KEYS else value
    if record.exc_info:
        fields["exc"] = redact(logging.Formatter().formatException(record.exc_info))
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_fields(record), default=str)


class KeyValueFormatter(logging.Formatter):
    """logfmt-style `key=value` pairs, values quoted when they contain spaces."""

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in _fields(record).items():
            text = redact(str(value))
            if not text or any(c in text for c in ' ="'):
                text = json.dumps(text)
            parts.append(f"{key}={text}")
        return " ".join(parts)


def configure_logging(level: str = "info", fmt: str = "kv", stream: Any = None) -> None:
    """Route every logger to one handler on stderr in the chosen format."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
