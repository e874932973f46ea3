"""`/api/v1/tokens` (admin): create (secret shown once), list, revoke."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from sqlmodel import Session, col, select

from controlplane.api.deps import Admin, ContextDep, SessionDep
from controlplane.api.errors import conflict, not_found
from controlplane.auth import Role, mint_token
from controlplane.eventlog import record_event
from controlplane.models import ApiToken, Host
from protocol.rest import TokenCreate, TokenCreated, TokenOut

router = APIRouter(prefix="/api/v1/tokens", tags=["tokens"])


def token_out(row: ApiToken, host: str | None) -> TokenOut:
    """A token without its secret."""
    return TokenOut(
        id=row.key_id,
        name=row.name,
        role=row.role,
        host=host,
        expires_at=row.expires_at,
        uses_left=row.uses_left,
        created_at=row.created_at,
        created_by=row.created_by,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


def _host_names(session: Session) -> dict[int, str]:
    return {h.id: h.name for h in session.exec(select(Host)).all() if h.id is not None}


@router.post("", response_model=TokenCreated, status_code=201)
def create_token(
    body: TokenCreate, session: SessionDep, ctx: ContextDep, who: Admin
) -> TokenCreated:
    """Mint a token; the response is the only place its secret ever appears."""
    now = ctx.clock()
    expires = now + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
    new = mint_token(
        body.name, Role(body.role), now, expires_at=expires, uses=body.uses, created_by=who.actor
    )
    session.add(new.row)
    record_event(
        session,
        now,
        who.actor,
        "token.created",
        f"token/{new.row.key_id}",
        f"token {body.name} ({body.role}) created",
        role=body.role,
        name=body.name,
    )
    session.commit()
    return TokenCreated(**token_out(new.row, None).model_dump(), secret=new.secret)


@router.get("", response_model=list[TokenOut])
def list_tokens(session: SessionDep, _who: Admin, include_revoked: bool = False) -> list[TokenOut]:
    """Every token (never a secret); revoked ones only when asked."""
    query = select(ApiToken).order_by(col(ApiToken.id))
    if not include_revoked:
        query = query.where(col(ApiToken.revoked_at).is_(None))
    hosts = _host_names(session)
    return [token_out(t, hosts.get(t.host_id or -1)) for t in session.exec(query).all()]


@router.delete("/{ref}", response_model=TokenOut)
def revoke_token(
    ref: Annotated[str, PathParam(max_length=63, description="token id or unique name")],
    session: SessionDep,
    ctx: ContextDep,
    who: Admin,
) -> TokenOut:
    """Revoke a token by id, or by name when exactly one active token has that name."""
    row = session.exec(select(ApiToken).where(ApiToken.key_id == ref)).first()
    if row is None:
        named = session.exec(
            select(ApiToken).where(ApiToken.name == ref, col(ApiToken.revoked_at).is_(None))
        ).all()
        if len(named) > 1:
            raise conflict(f"{len(named)} active tokens are named {ref!r}: revoke one by its id")
        row = named[0] if named else None
    if row is None:
        raise not_found(f"token {ref!r}")
    if row.revoked_at is None:
        now = ctx.clock()
        row.revoked_at = now
        session.add(row)
        record_event(
            session,
            now,
            who.actor,
            "token.revoked",
            f"token/{row.key_id}",
            f"token {row.name} ({row.role}) revoked",
        )
        session.commit()
        ctx.token_cache.drop_key(row.key_id)
    return token_out(row, _host_names(session).get(row.host_id or -1))
