"""First start: create the first admin token, once."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controlplane.auth import Role, mint_token
from controlplane.eventlog import record_event
from controlplane.models import ApiToken

ADMIN_TOKEN_NAME = "admin"


def ensure_admin_token(engine: Engine, now: datetime | None = None) -> str | None:
    """Create the first admin token and return its secret; None when any admin token exists.

    "Exists" includes revoked and expired admin tokens: the secret is handed out only on the
    very first start, never again (an operator who lost it mints a new one with an admin token).
    """
    now = now or datetime.now(UTC)
    with Session(engine) as session:
        if session.exec(select(ApiToken.id).where(ApiToken.role == Role.ADMIN.value)).first():
            return None
        new = mint_token(ADMIN_TOKEN_NAME, Role.ADMIN, now, created_by="system:bootstrap")
        session.add(new.row)
        record_event(
            session,
            now,
            "system:bootstrap",
            "token.created",
            f"token/{new.row.key_id}",
            "first admin token created on first start",
            role=Role.ADMIN.value,
            name=ADMIN_TOKEN_NAME,
        )
        session.commit()
        return new.secret


def discard_admin_token(engine: Engine, secret: str, now: datetime | None = None) -> None:
    """Delete the first admin token when its secret reached nobody (it could not be saved).

    Deleted, not revoked: `ensure_admin_token` then makes a new one on the next start, instead
    of a control plane nobody can administer.
    """
    now = now or datetime.now(UTC)
    key_id = secret.split("_")[1] if secret.count("_") >= 2 else ""
    with Session(engine) as session:
        row = session.exec(
            select(ApiToken).where(ApiToken.key_id == key_id, ApiToken.role == Role.ADMIN.value)
        ).first()
        if row is None:
            return
        session.delete(row)
        record_event(
            session,
            now,
            "system:bootstrap",
            "token.discarded",
            f"token/{key_id}",
            "first admin token deleted: it could not be saved, and nothing else showed it",
        )
        session.commit()
