"""Client tokens used in ways worth a look: the anomalies of the access audit (a token whose
request rate or error share jumped, an expired token still tried, a revoked token still tried),
one warning each, naming the token and what to do: rotate it, revoke it, or check its client.

The control plane judges what is anomalous and says it in words; the rule picks the fix by what
kind of anomaly it is (`anomaly_kind`) and quotes the token's figures as evidence. Without an
audit (the caller is not an admin) it says nothing: `collect` leaves a note instead.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

from doctor.findings import Evidence, Finding, FleetSnapshot
from protocol.logs import TokenAudit

RULE = "access.audit"

AnomalyKind = Literal["revoked", "expired", "unknown", "errors", "rate", "other"]
# The words that say which kind an anomaly is, checked in this order (a revoked token's
# refusals are not a jump in its rate).
_KIND_WORDS: tuple[tuple[AnomalyKind, tuple[str, ...]], ...] = (
    ("revoked", ("revoked",)),
    ("expired", ("expired", "expiry")),
    ("unknown", ("unknown token", "not known", "never issued")),
    ("errors", ("error",)),
    ("rate", ("rate", "requests", "traffic", "jump")),
)


def anomaly_kind(token: TokenAudit, anomaly: str) -> AnomalyKind:
    """What kind of anomaly the words of ANOMALY describe (a token with no name is one the
    control plane never issued)."""
    words = anomaly.lower()
    for kind, markers in _KIND_WORDS:
        if any(marker in words for marker in markers):
            return kind
    return "unknown" if not token.token else "other"


def _time(moment: datetime | None) -> str:
    if moment is None:
        return "never"
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _fix(kind: AnomalyKind, token: TokenAudit) -> str:
    name = token.token
    revoke = f"`dctl token revoke {name}`"
    if kind == "revoked":
        return (
            f"a client still sends revoked token {name} (last tried {_time(token.last_seen)}): "
            "find it and give it a current token; if nobody should hold this one, treat it as "
            "leaked and check what it reached (`dctl audit`)"
        )
    if kind == "expired":
        scope = f" --deployments {','.join(token.deployments)}" if token.deployments else ""
        return (
            f"rotate: create a new token for this client (`dctl token create {name}-2 --role "
            f"client{scope} --expires 90d`), hand it over, and stop the client sending the "
            "expired one"
        )
    if kind == "unknown":
        return (
            "requests carry tokens this control plane never issued: check the client's "
            "configuration (a token from another fleet?), or block the sender if it is probing"
        )
    if kind == "errors":
        deployments = ", ".join(token.deployments) or "DEPLOYMENT"
        return (
            f"check the client of {name}: its requests fail (`dctl requests {deployments} "
            "--errors` shows which); if the fleet is at fault, `dctl doctor` the deployment"
        )
    if kind == "rate":
        return (
            f"check the client of {name} (a retry loop, a new job?); if the traffic is not its "
            f"own, revoke the token ({revoke}) and issue the client a new one"
        )
    return f"check the client of {name}; if the use is not its own, revoke the token ({revoke})"


def _evidence(token: TokenAudit) -> Evidence:
    figures: Evidence = {
        "requests": token.requests,
        "errors": token.errors,
        "error_share": round(token.error_share, 3),
        "rate_limited": token.rate_limited,
        "last_seen": _time(token.last_seen),
    }
    for reason, count in sorted(token.refused.items()):
        figures[f"refused_{reason}"] = count
    return figures


def anomalies(snap: FleetSnapshot) -> list[Finding]:
    """A warning per anomaly of the access audit, naming the token and what to do."""
    if snap.audit is None:
        return []
    return [
        Finding(
            rule=RULE,
            severity="warning",
            subject=f"token/{token.token or '(unknown)'}",
            summary=anomaly,
            evidence=_evidence(token),
            fix=_fix(anomaly_kind(token, anomaly), token),
        )
        for token in snap.audit.tokens
        for anomaly in token.anomalies
    ]
