"""How `dctl logs` and `dctl requests` print what the control plane keeps: log lines prefixed
with where they came from, request summaries as a table, fields, JSON or CSV.

Every string printed here came from a server (log lines from engines, through agents), so each
goes through `printable` (or a JSON encoding that escapes control characters) first.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from cli.output import Column
from protocol.plain_text import printable

if TYPE_CHECKING:
    from protocol.logs import LogEntry


def origin(entry: LogEntry) -> str:
    """Where a line came from: `gpu-1 i12` for instance 12's engine, `gpu-1 agent` for the
    host's agent."""
    if entry.source == "agent" or entry.instance_id is None:
        return f"{entry.host} agent"
    return f"{entry.host} i{entry.instance_id}"


def line_text(entry: LogEntry) -> str:
    """One line as `dctl logs` prints it: `gpu-1 i12 | text`, control characters removed."""
    return printable(f"{origin(entry)} | {entry.line}")


def json_line(entry: LogEntry) -> str:
    """One line as `dctl logs --json` prints it: the LogEntry as one line of JSON (ASCII, so a
    control character in the text is an escape, never sent to the terminal)."""
    return json.dumps(entry.model_dump(mode="json"), ensure_ascii=True)


def time_ordered(entries: Iterable[LogEntry]) -> list[LogEntry]:
    """ENTRIES merged in time order (hosts' lines interleave), ties in the order stored."""
    return sorted(entries, key=lambda e: (e.time, e.id))


# --- request summaries ------------------------------------------------------------------------


def seconds(value: Any) -> str | None:
    """0.0421 -> `42 ms`, 3.2 -> `3.20 s`; None for nothing."""
    if not isinstance(value, int | float):
        return None
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _version_pool(row: Mapping[str, Any]) -> str | None:
    version, pool = row.get("version") or "", row.get("pool") or ""
    return "/".join(part for part in (version, pool) if part) or None


def _tokens(row: Mapping[str, Any]) -> str | None:
    prompt, completion = row.get("prompt_tokens"), row.get("completion_tokens")
    if prompt is None and completion is None:
        return None
    return f"{'-' if prompt is None else prompt}/{'-' if completion is None else completion}"


def _fixed(key: str, places: int) -> Callable[[Mapping[str, Any]], str | None]:
    def read(row: Mapping[str, Any]) -> str | None:
        value = row.get(key)
        return None if value is None else f"{value:.{places}f}"

    return read


REQUEST_COLUMNS: list[Column] = [
    ("time", "time"),
    ("request", "request_id"),
    ("token", "token"),
    ("version/pool", _version_pool),
    ("status", "status"),
    ("prompt/completion", _tokens),
    ("steps/block", _fixed("steps_per_block", 1)),
    ("tok/forward", _fixed("tokens_per_forward", 2)),
    ("ttft", lambda r: seconds(r.get("ttft_s"))),
    ("latency", lambda r: seconds(r.get("latency_s"))),
]
# `dctl logs --request ID`: the gateway's summary above the engine's lines.
REQUEST_FIELDS: list[Column] = [
    ("request", "request_id"),
    ("time", "time"),
    ("token", "token"),
    ("version/pool", _version_pool),
    ("instance", "instance_id"),
    ("gateway", "gateway"),
    ("status", "status"),
    ("prompt/completion", _tokens),
    ("steps/block", _fixed("steps_per_block", 1)),
    ("tok/forward", _fixed("tokens_per_forward", 2)),
    ("ttft", lambda r: seconds(r.get("ttft_s"))),
    ("latency", lambda r: seconds(r.get("latency_s"))),
    ("stream", "stream"),
]


def write_csv(
    rows: Iterable[Mapping[str, Any]], fields: list[str], out: TextIO | None = None
) -> None:
    """ROWS as CSV with a header row of FIELDS; nothing as an empty cell, text made printable."""
    writer = csv.writer(out or sys.stdout, lineterminator="\n")
    writer.writerow(fields)
    for row in rows:
        writer.writerow([_csv_cell(row.get(name)) for name in fields])


def _csv_cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return printable(value) if isinstance(value, str) else value
