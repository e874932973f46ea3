"""`dctl logs DEPLOYMENT`: the log lines of a deployment's engines (and, with `--agent`, of its
hosts' agents), as the agents shipped them to the control plane, merged in time order.

Each line is printed as `HOST iINSTANCE | text` (`HOST agent | text` for an agent's), control
characters removed; `--json` prints each `LogEntry` as a line of JSON instead. The command pages
through what the control plane keeps with its cursor; `--follow` then streams new lines
(`cli.log_stream`) until Ctrl-C (exit 0), reconnecting after the last line shown when the
connection drops; when it cannot, it says so, names the cursor to resume from, and exits 1.
`--request ID` prints the gateway's summary of that request above its lines (with `--json`, the
lines alone: `dctl requests DEPLOYMENT --request ID --json` prints the summary).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import fail
from cli.log_stream import RECONNECT_DELAYS_S
from cli.logs_view import REQUEST_FIELDS, json_line, line_text, time_ordered
from cli.options import duration_option
from cli.output import plain, print_fields
from cli.remote import connect, current_context

if TYPE_CHECKING:
    from client.http import ControlPlaneClient
    from protocol.logs import LogEntry

# Lines per page: the control plane answers at most this many, oldest first, and a cursor.
PAGE_LINES = 1000


def _show(as_json: bool) -> Callable[[LogEntry], None]:
    def show(entry: LogEntry) -> None:
        sys.stdout.write((json_line(entry) if as_json else line_text(entry)) + "\n")
        sys.stdout.flush()

    return show


def print_history(
    api: ControlPlaneClient, name: str, filters: dict[str, Any], after: int | None, as_json: bool
) -> int:
    """Print every kept line that matches FILTERS (after cursor AFTER), page by page; return the
    cursor after the last one. Lines the agents had to drop are said on stderr."""
    show, dropped = _show(as_json), 0
    while True:
        page = api.deployment_logs(name, **filters, after=after, limit=PAGE_LINES)
        for entry in time_ordered(page.items):
            show(entry)
        after, dropped = page.next_cursor, max(dropped, page.dropped)
        if len(page.items) < PAGE_LINES:
            break
    if dropped:
        print(
            f"note: the agents dropped {dropped} line(s) of this range (their buffers were full "
            "while the control plane was out of reach)",
            file=sys.stderr,
        )
    return after


def print_request_summary(api: ControlPlaneClient, name: str, request_id: str) -> None:
    """The gateway's summary of request REQUEST_ID (what `dctl requests` lists), then a blank
    line; a note on stderr when no gateway reported it (summaries are sampled under load)."""
    found = api.deployment_requests(name, request=request_id)
    if not found:
        print(
            f"note: no gateway summary of request {request_id!r} (the gateways report a sample "
            "of requests under load, and only recent ones are kept)",
            file=sys.stderr,
        )
        return
    print_fields(plain(found[0]), REQUEST_FIELDS)
    sys.stdout.write("\n")


@contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C and SIGTERM as KeyboardInterrupt while following, the handlers restored after.

    Explicitly: a process started in the background by a non-interactive shell inherits SIGINT
    ignored, and Python then installs no KeyboardInterrupt handler of its own."""

    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def follow_lines(
    name: str,
    filters: dict[str, Any],
    after: int,
    as_json: bool,
    delays: Sequence[float] = RECONNECT_DELAYS_S,
) -> None:
    """Stream new lines after cursor AFTER until interrupted (KeyboardInterrupt passes through);
    exit 1 with the cursor to resume from when the stream drops and cannot be opened again, or
    is refused."""
    from cli.log_stream import FollowFailed, LogStream, StreamRefused, follow
    from client.calls import deployment_logs, follow_logs_path

    # The follow endpoint takes the filters of the logs call: one place turns them into a query.
    query = deployment_logs(name, **{k: v for k, v in filters.items() if k != "since"}).query()
    stream = LogStream(current_context(), follow_logs_path(name), query or {})
    try:
        follow(stream, after, _show(as_json), delays=delays)
    except StreamRefused as exc:
        fail(f"following the logs of {name}: {exc}")
    except FollowFailed as exc:
        fail(
            f"the log stream of {name} dropped and {exc.attempts} reconnect(s) failed "
            f"({exc.reason}); resume after the last line shown: "
            f"dctl logs {name} --follow --after {exc.after}"
        )


def logs(
    deployment: str = typer.Argument(..., help="The deployment whose lines to print."),
    instance: int | None = typer.Option(None, "--instance", min=1, help="Only this instance."),
    host: str | None = typer.Option(None, "--host", help="Only lines from this host."),
    since: str | None = typer.Option(
        None, "--since", help="Only lines this recent, e.g. 10m, 2h (default: the last hour)."
    ),
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Then keep printing new lines until Ctrl-C."
    ),
    grep: str | None = typer.Option(None, "--grep", help="Only lines containing this text."),
    agent: bool = typer.Option(
        False, "--agent", help="The deployment's hosts' agents' lines too (`HOST agent | ...`)."
    ),
    request: str | None = typer.Option(
        None, "--request", help="Only this request's lines, under the gateway's summary of it."
    ),
    after: int | None = typer.Option(
        None, "--after", min=0, help="Only lines after this cursor (what a dropped --follow names)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print each line as a LogEntry JSON object, one per line."
    ),
) -> None:
    """Log lines of DEPLOYMENT's engines, merged in time order, each prefixed with host and
    instance; --follow streams new ones."""
    filters: dict[str, Any] = {
        "since": None if since is None else _ago(duration_option(since, "--since")),
        "instance": instance,
        "host": host,
        "grep": grep,
        "request": request,
        "agent": agent,
    }
    try:
        with _interruptible() if follow else nullcontext():
            with connect() as api:
                if request is not None and not as_json:
                    print_request_summary(api, deployment, request)
                cursor = print_history(api, deployment, filters, after, as_json)
            if follow:
                follow_lines(deployment, filters, cursor, as_json)
    except KeyboardInterrupt:
        if not follow:
            raise
        # Ctrl-C is how a person stops following: not a failure.


def _ago(seconds: int) -> datetime:
    return datetime.now(UTC) - timedelta(seconds=seconds)


def register(app: typer.Typer) -> None:
    """Attach `dctl logs` to the root app."""
    app.command("logs")(logs)
