"""`/api/v1/tokens` (admin): create (secret shown once), list, revoke."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam

from controlplane.api.deps import Admin, ContextDep, SessionDep
from controlplane.api.views import token_out
from controlplane.services import tokens
from protocol.rest import TokenCreate, TokenCreated, TokenOut

router = APIRouter(prefix="/api/v1/tokens", tags=["tokens"])


@router.post("", response_model=TokenCreated, status_code=201)
def create_token(
    body: TokenCreate, session: SessionDep, ctx: ContextDep, who: Admin
) -> TokenCreated:
    """Mint a token; the response is the only place its secret ever appears."""
    new = tokens.create_token(session, ctx.clock(), who.actor, body)
    session.commit()
    return TokenCreated(**token_out(new.row, None).model_dump(), secret=new.secret)


@router.get("", response_model=list[TokenOut])
def list_tokens(session: SessionDep, _who: Admin, include_revoked: bool = False) -> list[TokenOut]:
    """Every token (never a secret); revoked ones only when asked."""
    rows = tokens.list_tokens(session, include_revoked)
    hosts = tokens.host_names(session, rows)
    return [token_out(t, hosts.get(t.host_id or -1)) for t in rows]


@router.delete("/{ref}", response_model=TokenOut)
def revoke_token(
    ref: Annotated[str, PathParam(max_length=63, description="token id or unique name")],
    session: SessionDep,
    ctx: ContextDep,
    who: Admin,
) -> TokenOut:
    """Revoke a token by id, or by name when exactly one active token has that name."""
    row = tokens.revoke_token(session, ctx.clock(), who.actor, ref)
    session.commit()
    ctx.token_cache.drop_key(row.key_id)
    return token_out(row, tokens.host_names(session, [row]).get(row.host_id or -1))
