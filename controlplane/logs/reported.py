"""What gateways report beside their traffic windows: request summaries (sampled), every
request per client token, and the requests they refused per token and reason.

Written in the traffic report's transaction; a report posted again (a retry after a lost
answer) stores nothing twice: its per-token rows, keyed by gateway and interval, say it came.
"""

from __future__ import annotations

from sqlalchemy import insert
from sqlmodel import Session, col, select

from controlplane.models import Deployment, RequestRecord, TokenUse
from protocol.gateway import TrafficReport


def record_reported(session: Session, report: TrafficReport) -> int:
    """Store REPORT's summaries, usage and refusals; returns the rows written (0 for a report
    stored before, or one with none of them)."""
    if not (report.requests or report.usage or report.refusals):
        return 0
    seen = session.exec(
        select(TokenUse.id).where(
            TokenUse.gateway == report.gateway,
            TokenUse.started_at == report.started_at,
            TokenUse.ended_at == report.ended_at,
        )
    ).first()
    if seen is not None:
        return 0
    names = {r.deployment for r in report.requests}
    ids = dict(
        session.exec(
            select(Deployment.name, Deployment.id).where(col(Deployment.name).in_(names))
        ).all()
    )
    records = [
        {
            "deployment_id": ids[r.deployment],
            "gateway": report.gateway,
            **r.model_dump(exclude={"deployment"}),
        }
        for r in report.requests
        if r.deployment in ids  # a deployment deleted since: nothing to attach it to
    ]

    def use(**fields: object) -> dict[str, object]:
        """A TokenUse row of this report's interval: FIELDS over zeroes."""
        return {"gateway": report.gateway, "started_at": report.started_at,
                "ended_at": report.ended_at, "token": "", "key_id": "", "deployment": "",
                "reason": "", "requests": 0, "errors": 0, "rate_limited": 0, "refused": 0,
                **fields}  # fmt: skip

    uses = [
        use(**u.model_dump(include={"token", "deployment", "requests", "errors", "rate_limited"}))
        for u in report.usage
    ]
    uses += [
        use(token=r.token, key_id=r.key_id, reason=r.reason, refused=r.count)
        for r in report.refusals
    ]
    if not uses:
        uses.append(use())  # summaries alone (an older gateway): a row keys the interval
    if records:
        session.execute(insert(RequestRecord), records)
    session.execute(insert(TokenUse), uses)
    return len(records) + len(uses)
