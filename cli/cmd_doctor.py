"""`dctl doctor [DEPLOYMENT | --host H] [--json]`: what is wrong with the fleet, and the fix.

Reads live state and the last minutes of samples from the control plane, runs the rules of
`doctor` over them and prints the findings, errors first. Exit 0 when no finding is an
error, 1 when one is, 2 on a usage error (an unknown deployment or host among them).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer

from cli.exits import FAILURE, USAGE, fail
from cli.output import JSON_OPTION, print_json
from cli.remote import connect
from protocol.plain_text import printable

if TYPE_CHECKING:
    from doctor import Finding


def render(findings: list[Finding]) -> str:
    """Findings as text for people: severity, subject and summary, then evidence and fix."""
    if not findings:
        return "no findings\n"
    lines = []
    for f in findings:
        lines.append(f"{f.severity.upper():7} {f.subject}: {f.summary} [{f.rule}]")
        figures = ", ".join(f"{k}={v}" for k, v in f.evidence.items())
        lines.append(f"        evidence: {figures}")
        lines.append(f"        fix: {f.fix}")
    # Findings quote what agents reported (check reasons, instance messages): made inert.
    return "".join(printable(line) + "\n" for line in lines)


def doctor(
    deployment: str | None = typer.Argument(None, help="Only this deployment."),
    host: str | None = typer.Option(None, "--host", help="Only this host."),
    as_json: bool = JSON_OPTION,
) -> None:
    """Diagnose the fleet: load failures, overflow and timeouts, slow generation, hardware."""
    from client.errors import ClientError
    from doctor import diagnose, has_error
    from doctor.collect import collect

    with connect() as api:
        try:
            snapshot = collect(api, deployment=deployment, host=host)
        except ClientError as exc:
            if exc.status != 404:
                raise
            what = f"deployment {deployment!r}" if deployment else f"host {host!r}"
            fail(f"{what} not found: `dctl deploy list` / `dctl host list` name them", USAGE)
    findings = diagnose(snapshot)
    for note in snapshot.notes:
        # On stderr: --json stays a list of findings, and a skipped rule is not one.
        print(f"note: {printable(note)}", file=sys.stderr)
    if as_json:
        print_json([f.to_json() for f in findings])
    else:
        sys.stdout.write(render(findings))
    if has_error(findings):
        raise typer.Exit(FAILURE)


def register(app: typer.Typer) -> None:
    """Attach `dctl doctor` to the root app."""
    app.command("doctor")(doctor)
