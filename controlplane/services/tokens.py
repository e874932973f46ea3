"""API tokens: mint (the secret is returned once), list, revoke, and re-key tokens for hosts."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.auth import BOOTSTRAP_DEFAULT_LIFETIME, NewToken, Role, mint_token
from controlplane.eventlog import record_event
from controlplane.models import ApiToken, Deployment, Host
from controlplane.services.errors import Conflict, NotFound
from controlplane.services.hosts import get_host
from protocol.rest import TokenCreate


def create_token(session: Session, now: datetime, actor: str, spec: TokenCreate) -> NewToken:
    """Mint a token; the caller shows its secret once, it is never stored.

    A bootstrap token without an expiry gets `BOOTSTRAP_DEFAULT_LIFETIME` (24 h). A client
    token's `deployments` must all exist now (NotFound names those that do not); one deleted
    later stays listed and applies again to a deployment created under its name.
    """
    expires = now + timedelta(seconds=spec.expires_in_s) if spec.expires_in_s else None
    if expires is None and spec.role == Role.BOOTSTRAP.value:
        expires = now + BOOTSTRAP_DEFAULT_LIFETIME
    deployments = _existing_deployments(session, spec.deployments)
    new = mint_token(
        spec.name, Role(spec.role), now, expires_at=expires, uses=spec.uses, created_by=actor
    )
    new.row.deployments = deployments
    new.row.allow_pool_pin = spec.allow_pool_pin
    new.row.max_concurrency = spec.max_concurrency
    new.row.labels = dict(spec.labels) if spec.labels is not None else None
    session.add(new.row)
    record_event(
        session,
        now,
        actor,
        "token.created",
        f"token/{new.row.key_id}",
        f"token {spec.name} ({spec.role}) created",
        role=spec.role,
        name=spec.name,
        deployments=deployments,
        allow_pool_pin=spec.allow_pool_pin,
        max_concurrency=spec.max_concurrency,
        labels=new.row.labels,
    )
    return new


def _existing_deployments(session: Session, names: list[str] | None) -> list[str] | None:
    """NAMES without repeats, in order, once each is known to exist; None stays None."""
    if names is None:
        return None
    unique = list(dict.fromkeys(names))
    known = set(session.exec(select(Deployment.name).where(col(Deployment.name).in_(unique))).all())
    missing = [n for n in unique if n not in known]
    if missing:
        listed = ", ".join(repr(n) for n in missing)
        raise NotFound(f"deployment(s) {listed}")
    return unique


def rekey_host(session: Session, now: datetime, actor: str, name: str) -> NewToken:
    """A one-use bootstrap token that registers host `name` again (and only it), for 24 h.

    Nothing changes for the host until an agent registers with it: then every token bound to
    the host is revoked (the old agent token first of all). An earlier re-key token of the host
    that was never used is revoked now, so only the newest one works.
    """
    host = get_host(session, name)
    session.execute(
        update(ApiToken)
        .where(
            col(ApiToken.host_id) == host.id,
            col(ApiToken.role) == Role.BOOTSTRAP.value,
            col(ApiToken.revoked_at).is_(None),
        )
        .values(revoked_at=now)
    )
    new = mint_token(
        f"rekey-{name}"[:63],
        Role.BOOTSTRAP,
        now,
        host_id=host.id,
        expires_at=now + BOOTSTRAP_DEFAULT_LIFETIME,
        uses=1,
        created_by=actor,
    )
    session.add(new.row)
    record_event(
        session,
        now,
        actor,
        "host.rekey_issued",
        f"host/{name}",
        f"one-use bootstrap token {new.row.key_id} issued to register host {name} again; its "
        "current agent token works until an agent registers with it",
        token=new.row.key_id,
    )
    return new


def list_tokens(session: Session, include_revoked: bool = False) -> list[ApiToken]:
    """Every token, oldest first; revoked ones only when asked."""
    query = select(ApiToken).order_by(col(ApiToken.id))
    if not include_revoked:
        query = query.where(col(ApiToken.revoked_at).is_(None))
    return list(session.exec(query).all())


def get_token(session: Session, ref: str) -> ApiToken:
    """The token with id `ref`, else the one active token named `ref`; NotFound or Conflict."""
    row = session.exec(select(ApiToken).where(ApiToken.key_id == ref)).first()
    if row is not None:
        return row
    named = session.exec(
        select(ApiToken).where(ApiToken.name == ref, col(ApiToken.revoked_at).is_(None))
    ).all()
    if len(named) > 1:
        raise Conflict(f"{len(named)} active tokens are named {ref!r}: revoke one by its id")
    if not named:
        raise NotFound(f"token {ref!r}")
    return named[0]


def revoke_token(session: Session, now: datetime, actor: str, ref: str) -> ApiToken:
    """Revoke a token by id or unique name (revoking it again changes nothing)."""
    row = get_token(session, ref)
    if row.revoked_at is None:
        row.revoked_at = now
        session.add(row)
        record_event(
            session,
            now,
            actor,
            "token.revoked",
            f"token/{row.key_id}",
            f"token {row.name} ({row.role}) revoked",
        )
    return row


def host_names(session: Session, tokens: Iterable[ApiToken]) -> dict[int, str]:
    """Names of the hosts these (agent) tokens are bound to, by host id."""
    ids = {t.host_id for t in tokens if t.host_id is not None}
    if not ids:
        return {}
    rows = session.exec(select(Host.id, Host.name).where(col(Host.id).in_(ids))).all()
    return {hid: name for hid, name in rows if hid is not None}
