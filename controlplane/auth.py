"""Bearer tokens: `dctl_<id>_<random>` secrets, stored as SHA-256, checked in constant time."""

from __future__ import annotations

import hmac
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.models import ApiToken
from protocol.tokens import TOKEN_PREFIX, hash_secret, key_id_of
from protocol.vocabulary import Role

LAST_USED_RESOLUTION = timedelta(minutes=1)
# A bootstrap token minted without an expiry stops working after this: one forgotten in a
# provisioning script or a shell history must not register hosts for ever.
BOOTSTRAP_DEFAULT_LIFETIME = timedelta(hours=24)


# Roles each role includes: an admin may do what an operator may, and so on.
ROLE_GRANTS: dict[Role, frozenset[Role]] = {
    Role.VIEWER: frozenset({Role.VIEWER}),
    Role.OPERATOR: frozenset({Role.VIEWER, Role.OPERATOR}),
    Role.ADMIN: frozenset({Role.VIEWER, Role.OPERATOR, Role.ADMIN}),
    Role.BOOTSTRAP: frozenset({Role.BOOTSTRAP}),
    Role.AGENT: frozenset({Role.AGENT}),
    Role.GATEWAY: frozenset({Role.GATEWAY}),
    Role.CLIENT: frozenset({Role.CLIENT}),
}


class AuthError(Exception):
    """The request carries no usable token (HTTP 401); the message says why."""


class TokenRefused(AuthError):
    """A write that re-checks the token found it no longer valid (revoked, expired, used up)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: the authenticated token."""

    token_id: int
    key_id: str
    name: str
    role: Role
    host_id: int | None
    limited_uses: bool = False
    expires_at: datetime | None = None
    last_used_at: datetime | None = None

    def may(self, role: Role) -> bool:
        """True when this token's role includes `role`."""
        return role in ROLE_GRANTS[self.role]

    @property
    def actor(self) -> str:
        """How this caller appears in the audit log."""
        return f"token:{self.name}"


@dataclass(frozen=True)
class NewToken:
    """A freshly minted token: the row to store and the secret to show once."""

    row: ApiToken
    secret: str


def mint_token(
    name: str,
    role: Role,
    now: datetime,
    *,
    host_id: int | None = None,
    expires_at: datetime | None = None,
    uses: int | None = None,
    created_by: str = "",
) -> NewToken:
    """A new token row (not yet added to a session) and its secret."""
    key_id = secrets.token_hex(6)
    secret = f"{TOKEN_PREFIX}_{key_id}_{secrets.token_urlsafe(32)}"
    row = ApiToken(
        key_id=key_id,
        name=name,
        role=role.value,
        secret_sha256=hash_secret(secret),
        host_id=host_id,
        expires_at=expires_at,
        uses_left=uses,
        created_at=now,
        created_by=created_by,
    )
    return NewToken(row=row, secret=secret)


def parse_authorization(header: str | None) -> str:
    """The secret from an `Authorization: Bearer ...` header, or AuthError."""
    if not header:
        raise AuthError("missing bearer token: send `Authorization: Bearer dctl_...`")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthError("malformed Authorization header: use `Authorization: Bearer dctl_...`")
    return value.strip()


def authenticate(session: Session, secret: str, now: datetime, *, touch: bool = True) -> Principal:
    """Check a secret against the store: exists, matches, not revoked, expired or used up.

    With `touch`, writes `last_used_at` when it is due (`last_used_due`: at most once a minute,
    so reads stay reads); the caller commits. Without it this only reads, and the caller writes
    `last_used_at` where writing is cheap (the heartbeat path, on its writer).
    """
    key_id = key_id_of(secret)
    if key_id is None:
        raise AuthError("invalid token: not a dctl token (dctl_<id>_<secret>)")
    row = session.exec(select(ApiToken).where(ApiToken.key_id == key_id)).first()
    # Compare even when the row is missing, so timing does not reveal which ids exist.
    expected = row.secret_sha256 if row else "0" * 64
    if not hmac.compare_digest(expected, hash_secret(secret)) or row is None or row.id is None:
        raise AuthError("invalid token: unknown or wrong secret")
    if row.revoked_at is not None:
        raise AuthError(f"token {row.name!r} was revoked: ask an admin for a new one")
    if row.expires_at is not None and row.expires_at <= now:
        raise AuthError(f"token {row.name!r} expired at {row.expires_at.isoformat()}")
    if row.uses_left is not None and row.uses_left <= 0:
        raise AuthError(f"token {row.name!r} has no uses left")
    principal = Principal(
        token_id=row.id,
        key_id=row.key_id,
        name=row.name,
        role=Role(row.role),
        host_id=row.host_id,
        limited_uses=row.uses_left is not None,
        expires_at=row.expires_at,
        last_used_at=row.last_used_at,
    )
    if touch and last_used_due(principal, now):
        touch_last_used(session, principal.token_id, now)
    return principal


def last_used_due(principal: Principal, now: datetime) -> bool:
    """True when the token's `last_used_at` is older than its resolution (or unset)."""
    last = principal.last_used_at
    return last is None or now - last >= LAST_USED_RESOLUTION


def touch_last_used(session: Session, token_id: int, now: datetime) -> None:
    """Record that the token was used now (inside the caller's transaction)."""
    session.execute(update(ApiToken).where(col(ApiToken.id) == token_id).values(last_used_at=now))


class AgentTokenCache:
    """Who recently verified agent tokens belong to: identity only, never whether they still work.

    A hit spares a heartbeat the token query (the SHA-256 of the secret is still compared here),
    but not the check that matters across replicas: the heartbeat's own write verifies, in the
    same statement, that the token row is unrevoked, unexpired and bound to the host
    (`controlplane.heartbeat.observed_state`), so a token revoked on any replica fails its next
    heartbeat everywhere. Nothing else consults this cache: every other request authenticates
    against the store. Entries live `ttl` (a minute) so that the heartbeat path still refreshes
    `last_used_at` at its resolution; only agent tokens bound to a host and without a uses limit
    are kept, and only after the store accepted them, so a client cannot fill the cache with
    secrets of its own making. It holds at most `max_entries` (least recently used go first):
    a fleet re-registering for months must not grow it without end.
    """

    def __init__(self, ttl: timedelta = LAST_USED_RESOLUTION, max_entries: int = 50_000) -> None:
        self._ttl = ttl
        self._max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, Principal, datetime]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, secret: str, now: datetime) -> Principal | None:
        """The cached principal for `secret`, or None (not cached, stale, expired, mismatch)."""
        key_id = key_id_of(secret)
        if key_id is None:
            return None
        entry = self._entries.get(key_id)
        if entry is None:
            return None
        digest, principal, cached_at = entry
        expires_at = principal.expires_at
        if now - cached_at >= self._ttl or (expires_at is not None and expires_at <= now):
            self.drop_key(key_id)
            return None
        if not hmac.compare_digest(digest, hash_secret(secret)):
            return None
        return principal

    def put(self, secret: str, principal: Principal, now: datetime) -> None:
        """Remember a token that `authenticate` just accepted."""
        if principal.role != Role.AGENT or principal.host_id is None or principal.limited_uses:
            return
        with self._lock:
            self._entries[principal.key_id] = (hash_secret(secret), principal, now)
            self._entries.move_to_end(principal.key_id)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)

    def drop_key(self, key_id: str) -> None:
        """Forget one token (it was revoked, or a heartbeat's write refused it)."""
        with self._lock:
            self._entries.pop(key_id, None)

    def drop_host(self, host_id: int) -> None:
        """Forget every token bound to a host (re-registered or removed)."""
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry[1].host_id == host_id:
                    del self._entries[key]


def consume_use(session: Session, token_id: int) -> bool:
    """Spend one use of a limited token inside the caller's transaction; False when none left.

    The decrement is conditional (`uses_left > 0`) and its row count is the answer: requests
    that read the same `uses_left` in parallel cannot all spend the last use, since the
    database applies the UPDATEs one after the other and re-checks the condition for each.
    Every caller must honour a False.
    """
    row = session.get(ApiToken, token_id)
    if row is None or row.uses_left is None:
        return row is not None
    result = session.execute(
        update(ApiToken)
        .where(col(ApiToken.id) == token_id, col(ApiToken.uses_left) > 0)
        .values(uses_left=col(ApiToken.uses_left) - 1)
    )
    return bool(getattr(result, "rowcount", 0))
