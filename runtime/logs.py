"""Structured logging (JSON or key=value) with secrets redacted before anything is written.

The one log format of every dctl process — control plane, agent, gateway and engine — so that
one redaction covers them all. Redaction runs on the finished line, after the message, the extra
fields and the traceback have been put together, so a secret cannot slip through a field that
nobody thought to check (an exception text, a URL, a nested dict).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any, TextIO

REDACTED = "***"
# API tokens are `dctl_<id>_<random>`, instance API keys `dctl_ik_<random>`; bearer headers and
# `key=...` pairs may carry either, or a secret of another kind. A URL's `user:password@` and
# query string are secrets as often as not (webhooks, database URLs, signed links).
_SECRET_PATTERNS = [
    re.compile(r"dctl_[A-Za-z0-9]+_[A-Za-z0-9_\-]+"),
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=\-]+"),
]
_URL_END = r"\s\"'<>\\"  # where a URL in a log line ends (JSON escapes included)
_URL_PATTERNS = [
    re.compile(rf"(?i)(\b[a-z][a-z0-9+.\-]*://)[^/?#@{_URL_END}]*(?=@)"),
    re.compile(rf"(?i)(\b[a-z][a-z0-9+.\-]*://[^?#{_URL_END}]*\?)[^#{_URL_END}]+"),
]
# Loggers that write every request's URL at INFO (httpx: "HTTP Request: POST https://...").
_CHATTY = ("httpx", "httpcore")
# Extra fields whose value is a secret whatever it looks like: these names, and names ending in
# `_<name>` (`bootstrap_token`, `instance_api_key`), but not `token_id` or `token_name`.
_SECRET_KEYS = ("token", "secret", "password", "api_key", "apikey", "authorization")
# Attributes every LogRecord has, and uvicorn's ANSI-coloured copy of the message.
_RESERVED = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
FORMATS = ("json", "kv")
# One encoder for every line: `json.dumps(..., default=str)` builds a new one per call, which
# costs more than the encoding on a per-request log line (the gateway writes one per request).
_ENCODER = json.JSONEncoder(default=str)
_SECRET_KEY_RE = re.compile(r"(?i)^(?:.*_)?(?:" + "|".join(_SECRET_KEYS) + r")$")


def redact(text: str) -> str:
    """Replace anything that looks like a secret with `***`."""
    patterns = [*_SECRET_PATTERNS, *_URL_PATTERNS] if "://" in text else _SECRET_PATTERNS
    for pattern in patterns:
        text = pattern.sub(lambda m: (m.group(1) if m.groups() else "") + REDACTED, text)
    return text


def _names_a_secret(key: str) -> bool:
    return _SECRET_KEY_RE.match(key) is not None


def _encode(value: Any) -> str:
    """VALUE as JSON; plain numbers without the encoder's overhead."""
    if value.__class__ is int:
        return str(value)
    return _ENCODER.encode(value)


def _scrub(key: str, value: Any) -> Any:
    # Nested too: an engine config logged whole carries `service.api_key`. A number is never
    # one of our secrets (tokens and keys are strings): `kv_bytes_per_token` stays readable.
    if _names_a_secret(key) and not (value is None or isinstance(value, int | float)):
        return REDACTED
    if isinstance(value, dict):
        return {k: _scrub(str(k), v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub("", v) for v in value]
    return value


_second: tuple[int, str] = (-1, "")


def _timestamp(created: float, msecs: float) -> str:
    # Formatting the date is most of a line's cost: once per second is enough.
    global _second
    whole = int(created)
    if _second[0] != whole:
        _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{_second[1]}.{int(msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "ts": _timestamp(record.created, record.msecs),
        "level": record.levelname.lower(),
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in vars(record).items():
        if key in _RESERVED or key.startswith("_"):
            continue
        fields[key] = _scrub(key, value)
    if record.exc_info:
        fields["exc"] = logging.Formatter().formatException(record.exc_info)
    elif record.exc_text:
        fields["exc"] = record.exc_text
    if record.stack_info:
        fields["stack"] = record.stack_info
    return fields


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(_ENCODER.encode(_fields(record)))


class KeyValueFormatter(logging.Formatter):
    """logfmt-style `key=value` pairs; values that are not strings as JSON (`true`, `{"a": 1}`),
    quoted when they contain spaces, quotes or newlines, so every record stays one line."""

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        for key, value in _fields(record).items():
            text = value if isinstance(value, str) else _encode(value)
            if not text or any(c in text for c in ' ="\n'):
                text = _ENCODER.encode(text)
            parts.append(f"{key}={text}")
        return redact(" ".join(parts))


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for FMT (`json` or `kv`); anything else is a ValueError naming both."""
    if fmt == "json":
        return JsonFormatter()
    if fmt == "kv":
        return KeyValueFormatter()
    raise ValueError(f"log format {fmt!r}: choose one of {', '.join(FORMATS)}")


def configure_logging(level: str = "info", fmt: str = "kv", stream: TextIO | None = None) -> None:
    """Route every logger (uvicorn's too) to one handler on STREAM (stderr) in format FMT."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn may have given its loggers handlers of its own (its default log config): those
    # would print a second, unredacted copy of every line. Its levels go too: LEVEL decides.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    # Whatever LEVEL says: their request lines carry whole URLs (a webhook's secret, say).
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
