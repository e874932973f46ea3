"""The access audit (`dctl audit`, admin): per client token, what the gateways served and
refused over a range, and what looks wrong.

Counts are exact (every request, `TokenUse`), not the sampled summaries; 429s are the engines'
(in the usage) and the gateway's own rate and concurrency limits (in its refusals). A refusal
names the key id the caller presented; the store says what that key is now, so a refusal of a
key that was revoked reads "revoked" and one past its expiry "expired", whatever the gateway
could tell.

Anomalies, per token:
- its requests in the last day are over `RATE_JUMP` times its daily mean before (and at least
  `MIN_JUMP_REQUESTS`);
- its error share in the last day is `ERROR_JUMP` over its share before (at least
  `MIN_ERRORS` errors); with nothing before, a share of half or more;
- it was refused after its expiry, or after it was revoked: N times.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlmodel import Session, col, select

from controlplane.models import ApiToken, TokenUse
from protocol.logs import AuditReport, TokenAudit

DEFAULT_RANGE = timedelta(days=7)
DAY = timedelta(days=1)
RATE_JUMP = 3.0
MIN_JUMP_REQUESTS = 100
ERROR_JUMP = 0.2
MIN_ERRORS = 10


@dataclass
class _Tally:
    requests: int = 0
    errors: int = 0
    rate_limited: int = 0
    recent_requests: int = 0
    recent_errors: int = 0
    deployments: set[str] = field(default_factory=set)
    first: datetime | None = None
    last: datetime | None = None
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def seen(self, start: datetime, end: datetime) -> None:
        self.first = start if self.first is None else min(self.first, start)
        self.last = end if self.last is None else max(self.last, end)


def access_audit(session: Session, now: datetime, since: datetime | None = None) -> AuditReport:
    """Every client token's use and refusals since SINCE (default: 7 days)."""
    start = since or now - DEFAULT_RANGE
    recent = now - DAY
    rows = session.exec(
        select(TokenUse).where(col(TokenUse.ended_at) > start).order_by(col(TokenUse.ended_at))
    ).all()
    keys = {r.key_id for r in rows if r.key_id}
    tokens = {
        t.key_id: t
        for t in session.exec(select(ApiToken).where(col(ApiToken.key_id).in_(keys))).all()
    }
    tallies: dict[str, _Tally] = defaultdict(_Tally)
    for row in rows:
        if row.reason:
            known = tokens.get(row.key_id)
            name = known.name if known else row.token or _unknown(row.key_id)
            tally = tallies[name]
            reason = _reason(row.reason, known, row.ended_at)
            if reason == "rate_limited":
                tally.rate_limited += row.refused  # the gateway's own 429s
            else:
                tally.refused[reason] += row.refused
            tally.seen(row.started_at, row.ended_at)
            continue
        if not row.token:
            continue  # an interval's marker row
        tally = tallies[row.token]
        tally.requests += row.requests
        tally.errors += row.errors
        tally.rate_limited += row.rate_limited
        if row.deployment:
            tally.deployments.add(row.deployment)
        if row.ended_at > recent:
            tally.recent_requests += row.requests
            tally.recent_errors += row.errors
        if row.requests:
            tally.seen(row.started_at, row.ended_at)
    audits = [
        TokenAudit(
            token=name,
            requests=t.requests,
            errors=t.errors,
            rate_limited=t.rate_limited,
            error_share=round(t.errors / t.requests, 4) if t.requests else 0.0,
            deployments=sorted(t.deployments),
            first_seen=t.first,
            last_seen=t.last,
            refused=dict(t.refused),
            anomalies=_anomalies(t, now - start),
        )
        for name, t in sorted(tallies.items())
    ]
    return AuditReport(since=start, until=now, tokens=audits)


def _unknown(key_id: str) -> str:
    return f"(unknown key {key_id})" if key_id else "(no or malformed token)"


def _reason(reported: str, token: ApiToken | None, when: datetime) -> str:
    """What a refusal was, as the store knows the key now."""
    if token is None:
        return reported
    if token.revoked_at is not None and token.revoked_at <= when:
        return "revoked"
    if token.expires_at is not None and token.expires_at <= when:
        return "expired"
    return reported


def _anomalies(t: _Tally, span: timedelta) -> list[str]:
    found = []
    before_requests = t.requests - t.recent_requests
    before_errors = t.errors - t.recent_errors
    days_before = max((span - DAY) / DAY, 0.0)
    if days_before >= 1 and before_requests > 0:
        daily = before_requests / days_before
        if t.recent_requests >= MIN_JUMP_REQUESTS and t.recent_requests > RATE_JUMP * daily:
            found.append(
                f"request rate jumped: {t.recent_requests} in the last day against "
                f"{daily:.0f} a day before"
            )
    if t.recent_errors >= MIN_ERRORS and t.recent_requests:
        share = t.recent_errors / t.recent_requests
        if before_requests:
            earlier = before_errors / before_requests
            if share >= earlier + ERROR_JUMP:
                found.append(
                    f"error share jumped: {share:.0%} in the last day against {earlier:.0%}"
                )
        elif share >= 0.5:
            found.append(f"error share {share:.0%} in the last day")
    if t.refused.get("expired"):
        found.append(f"used after its expiry: refused {t.refused['expired']} time(s)")
    if t.refused.get("revoked"):
        found.append(f"revoked, still tried: refused {t.refused['revoked']} time(s)")
    return found
