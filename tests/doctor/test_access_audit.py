"""`access.audit`: a warning per anomaly of the access audit, naming the token and what to do
(revoke, rotate, check the client); nothing without an audit, and a note instead of a finding
when the caller may not read it (a snapshot in, findings out; `collect` against canned answers).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from cli.cmd_doctor import render
from cli.exits import OK
from client import ControlPlaneClient
from doctor import diagnose
from doctor.access import anomaly_kind
from doctor.collect import collect
from doctor.findings import Finding, FleetSnapshot
from protocol.logs import AuditReport, TokenAudit
from tests.cli.canned_api import CannedApi
from tests.cli.conftest import Dctl
from tests.doctor.builders import T0

RATE = "request rate jumped: 1000 in the last day against 40 a day before"
ERRORS = "error share jumped: 60% in the last day against 2%"
EXPIRED = "used after its expiry: refused 9 time(s)"
REVOKED = "revoked, still tried: refused 17 time(s)"


def token(name: str, *anomalies: str, **extra: Any) -> TokenAudit:
    values: dict[str, Any] = {
        "token": name, "requests": 1040, "errors": 30, "rate_limited": 2, "error_share": 0.0288,
        "deployments": ["web"], "first_seen": T0 - timedelta(days=6), "last_seen": T0,
        "anomalies": list(anomalies),
    }  # fmt: skip
    values.update(extra)
    return TokenAudit.model_validate(values)


def audited(*tokens: TokenAudit) -> FleetSnapshot:
    return FleetSnapshot(
        audit=AuditReport(since=T0 - timedelta(days=7), until=T0, tokens=list(tokens))
    )


def found(snap: FleetSnapshot) -> list[Finding]:
    return [f for f in diagnose(snap) if f.rule == "access.audit"]


def test_each_anomaly_is_a_warning_naming_the_token_and_what_to_do() -> None:
    snap = audited(
        token("alice", RATE, ERRORS),
        token("ci", REVOKED, requests=0, refused={"revoked": 17}, deployments=[]),
        token("nightly", EXPIRED, refused={"expired": 9}, deployments=["web", "chat"]),
        token("bob"),  # nothing odd: nothing said
    )
    rate, errors, revoked, expired = found(snap)
    assert all(f.severity == "warning" for f in (rate, errors, revoked, expired))
    assert (rate.subject, rate.summary) == ("token/alice", RATE)
    assert "check the client of alice" in rate.fix and "`dctl token revoke alice`" in rate.fix
    assert errors.subject == "token/alice" and "`dctl requests web --errors`" in errors.fix
    assert (revoked.subject, revoked.summary) == ("token/ci", REVOKED)
    assert revoked.fix.startswith("a client still sends revoked token ci (last tried 2026-01-01")
    assert revoked.evidence["refused_revoked"] == 17
    assert expired.subject == "token/nightly"
    assert expired.fix.startswith("rotate: create a new token for this client")
    assert "`dctl token create nightly-2 --role client --deployments web,chat" in expired.fix
    assert rate.evidence == {
        "requests": 1040, "errors": 30, "error_share": 0.029, "rate_limited": 2,
        "last_seen": "2026-01-01 12:00:00Z",
    }  # fmt: skip
    printed = render([revoked])
    assert printed.startswith(f"WARNING token/ci: {REVOKED} [access.audit]\n")


@pytest.mark.parametrize(
    ("name", "anomaly", "kind"),
    [
        ("a", RATE, "rate"),
        ("a", ERRORS, "errors"),
        ("a", "error share 70% in the last day", "errors"),
        ("a", EXPIRED, "expired"),
        ("a", REVOKED, "revoked"),
        ("a", "something new", "other"),
        ("", "something new", "unknown"),
    ],
)
def test_the_kind_of_anomaly_is_read_from_its_words(name: str, anomaly: str, kind: str) -> None:
    assert anomaly_kind(token(name), anomaly) == kind


def test_without_an_audit_the_rule_says_nothing() -> None:
    assert found(FleetSnapshot()) == []
    assert found(audited(token("bob"))) == []


@pytest.fixture
def canned() -> Iterator[CannedApi]:
    api = CannedApi()
    api.on("GET", "/api/v1/deployments", (200, []))
    api.on("GET", "/api/v1/hosts", (200, []))
    try:
        yield api
    finally:
        api.close()


def test_collect_reads_the_audit_for_the_whole_fleet(canned: CannedApi) -> None:
    report = audited(token("ci", REVOKED)).audit
    assert report is not None
    canned.on("GET", "/api/v1/audit", (200, report.model_dump(mode="json")))
    with ControlPlaneClient(canned.url, "t") as api:
        snap = collect(api)
    assert snap.audit == report and snap.notes == []


@pytest.mark.parametrize(
    ("status", "why"),
    [(403, "reading the access audit needs an admin token"),
     (404, "this control plane keeps no access audit (upgrade it)")],
)  # fmt: skip
def test_a_caller_who_may_not_read_the_audit_gets_a_note_not_a_finding(
    canned: CannedApi, tmp_path: Path, status: int, why: str
) -> None:
    canned.on("GET", "/api/v1/audit", (status, {"code": "x", "message": "admin role required"}))
    with ControlPlaneClient(canned.url, "t") as api:
        snap = collect(api)
    assert snap.audit is None and snap.notes == [f"access.audit skipped: {why}"]
    dctl = Dctl({"XDG_CONFIG_HOME": str(tmp_path), "DCTL_URL": canned.url, "DCTL_TOKEN": "t"})
    result = dctl("doctor")
    assert result.code == OK
    assert result.stdout == "no findings\n"
    assert result.stderr == f"note: access.audit skipped: {why}\n"
