"""`dctl audit` (admin): how each client token was used — requests, error share, 429s, the
deployments it called, first and last seen, requests refused by reason — and the anomalies the
control plane found (a rate or error share that jumped, an expired or revoked token still
tried), listed under the table. `dctl doctor` warns about the same anomalies."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import fail
from cli.options import duration_option
from cli.output import Column, plain, print_json, print_table
from cli.remote import connect
from protocol.plain_text import printable

if TYPE_CHECKING:
    from protocol.logs import AuditReport

# Refusals of a token the control plane does not know come under an empty name.
UNKNOWN_TOKEN = "(unknown token)"


def token_name(name: str) -> str:
    """A token's name as shown; the refusals of tokens nobody issued under one name."""
    return name or UNKNOWN_TOKEN


def _share(row: Mapping[str, Any]) -> str:
    return f"{row.get('error_share', 0) * 100:.1f}%"


AUDIT_COLUMNS: list[Column] = [
    ("token", lambda r: token_name(r.get("token") or "")),
    ("requests", "requests"),
    ("errors", _share),
    ("429s", "rate_limited"),
    ("deployments", "deployments"),
    ("first seen", "first_seen"),
    ("last seen", "last_seen"),
    ("refused", "refused"),
    ("anomalies", lambda r: len(r.get("anomalies") or []) or None),
]


def anomaly_lines(report: AuditReport) -> list[str]:
    """`TOKEN: what` per anomaly, for under the table (none: an empty list)."""
    return [
        printable(f"{token_name(t.token)}: {anomaly}")
        for t in report.tokens
        for anomaly in t.anomalies
    ]


def audit(
    since: str = typer.Option("7d", "--since", help="The range audited, e.g. 24h, 7d."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
) -> None:
    """Per client token: requests, errors, 429s, deployments, first/last seen, refusals and
    anomalies (admin)."""
    from client.errors import ClientError

    seconds = duration_option(since, "--since")
    with connect() as api:
        try:
            report = api.access_audit(since=datetime.now(UTC) - timedelta(seconds=seconds))
        except ClientError as exc:
            if exc.status != 403:
                raise
            fail(f"the access audit needs an admin token ({exc}); `dctl context use` an admin's")
    if as_json:
        print_json(plain(report))
        return
    print(f"client tokens from {_utc(report.since)} to {_utc(report.until)} UTC")
    print_table(
        [plain(t) for t in report.tokens], AUDIT_COLUMNS, empty="no client token used or tried"
    )
    lines = anomaly_lines(report)
    if lines:
        sys.stdout.write("\nanomalies:\n" + "".join(f"  {line}\n" for line in lines))


def _utc(moment: datetime) -> str:
    # The API's datetimes are UTC; one without a zone is read as UTC.
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M")


def register(app: typer.Typer) -> None:
    """Attach `dctl audit` to the root app."""
    app.command("audit")(audit)
