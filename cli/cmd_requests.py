"""`dctl requests DEPLOYMENT`: the gateways' summaries of a deployment's requests — who sent
them, which version and pool served them, how they ended, their tokens, diffusion figures and
timings — newest first, or the slowest; as a table, JSON or CSV (a header row of the fields)."""

from __future__ import annotations

import typer

from cli.exits import USAGE, fail
from cli.logs_view import REQUEST_COLUMNS, write_csv
from cli.options import duration_option
from cli.output import plain, print_json, print_table
from cli.remote import connect


def requests(
    deployment: str = typer.Argument(..., help="The deployment whose requests to list."),
    since: str = typer.Option("1h", "--since", help="Only requests this recent, e.g. 30m, 24h."),
    slowest: int | None = typer.Option(
        None, "--slowest", min=1, help="The N slowest (by latency) instead of the newest."
    ),
    errors: bool = typer.Option(
        False, "--errors", help="Only requests answered 5xx (or whose connection failed)."
    ),
    request: str | None = typer.Option(None, "--request", help="Only this request id."),
    limit: int | None = typer.Option(
        None, "--limit", min=1, help="At most this many (default: the control plane's)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
    as_csv: bool = typer.Option(False, "--csv", help="Print CSV with a header row."),
) -> None:
    """Request summaries of DEPLOYMENT from its gateways: newest first, or the slowest."""
    from datetime import UTC, datetime, timedelta

    from protocol.logs import RequestOut

    if as_json and as_csv:
        fail("--json and --csv: choose one", USAGE)
    seconds = duration_option(since, "--since")
    with connect() as api:
        found = api.deployment_requests(
            deployment,
            since=datetime.now(UTC) - timedelta(seconds=seconds),
            slowest=slowest,
            errors=errors,
            request=request,
            limit=limit,
        )
    rows = [plain(r) for r in found]
    if as_json:
        print_json(rows)
    elif as_csv:
        write_csv(rows, list(RequestOut.model_fields))
    else:
        print_table(rows, REQUEST_COLUMNS, empty=f"no requests in the last {since}")


def register(app: typer.Typer) -> None:
    """Attach `dctl requests` to the root app."""
    app.command("requests")(requests)
