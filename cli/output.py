"""How commands print results: a rich table for people by default, JSON for scripts (`--json`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import typer

from protocol.plain_text import printable

if TYPE_CHECKING:
    from pydantic import BaseModel

JSON_OPTION = typer.Option(False, "--json", help="Print JSON for scripts instead of a table.")

# A column: the header and either a key of the row or a function of the row.
Column = tuple[str, str | Callable[[Mapping[str, Any]], Any]]


def plain(model: BaseModel) -> dict[str, Any]:
    """An API object as JSON-ready data (what `--json` prints and tables read)."""
    return model.model_dump(mode="json")


def human_bytes(value: Any) -> str | None:
    """1536 -> `1.5 KiB`; None for a value that is not a number."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def print_json(data: Any) -> None:
    """Print DATA as indented JSON on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def cell(value: Any) -> str:
    """A value as a table cell: `-` for nothing, short ISO times, comma-joined lists; never a
    control character (the values come from servers, and from agents through them)."""
    return printable(_shown(value))


def _shown(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, str) and len(value) >= 19 and value[4] == "-" and value[10] == "T":
        # ISO timestamps from the API: seconds are precise enough for a person.
        return value[:19].replace("T", " ")
    if isinstance(value, list | tuple):
        return ", ".join(_shown(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_shown(v)}" for k, v in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _value(row: Mapping[str, Any], getter: str | Callable[[Mapping[str, Any]], Any]) -> Any:
    return getter(row) if callable(getter) else row.get(getter)


def print_table(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[Column], *, empty: str = "nothing yet"
) -> None:
    """Print ROWS as a table with COLUMNS; a short note when there are none."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = list(rows)
    # Piped output is for grep and awk: one line per row, however wide. A terminal keeps its
    # width and cuts long cells with an ellipsis instead of wrapping rows over several lines.
    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 100_000)
    if not rows:
        console.print(f"({empty})", highlight=False)
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for header, _ in columns:
        table.add_column(header.upper(), no_wrap=True, overflow="ellipsis")
    for row in rows:
        # Text, not a str: rich would read `[bold]` or `[link=...]` in a server's value as markup.
        table.add_row(*(Text(cell(_value(row, getter))) for _, getter in columns))
    with console.capture() as captured:
        console.print(table)
    # Rich pads every cell to the column width; trailing blanks only get in the way of diffs.
    sys.stdout.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def print_fields(record: Mapping[str, Any], fields: Sequence[Column]) -> None:
    """Print one record as `name: value` lines (for `show` commands)."""
    width = max(len(header) for header, _ in fields)
    for header, getter in fields:
        sys.stdout.write(f"{header + ':':<{width + 1}} {cell(_value(record, getter))}\n")


def emit(
    data: Any,
    *,
    as_json: bool,
    columns: Sequence[Column] | None = None,
    fields: Sequence[Column] | None = None,
    empty: str = "nothing yet",
) -> None:
    """Print DATA as JSON, as a table (a list with COLUMNS) or as fields (a record with FIELDS)."""
    if as_json:
        print_json(data)
    elif columns is not None:
        print_table(data, columns, empty=empty)
    elif fields is not None:
        print_fields(data, fields)
    else:
        print_json(data)
