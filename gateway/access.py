"""Who may send requests: client tokens checked against the routing table, and per-token rates.

Client tokens are control-plane tokens of role `client`: `dctl_<key id>_<random>`. The routing
table carries each one's SHA-256, scope and expiry, never the secret; a request's token is
hashed and compared in constant time. A revoked token leaves the table, so it stops working
within one routing poll.

Every refusal is a `ClientTokenRefused`, which says whom it counts against and why (the traffic
reports count them per token and reason): 401 for a missing, malformed, unknown, expired or
revoked token, 429 with `Retry-After` when a token spends its rate (a token bucket per key id)
or has as many requests in flight as it may (`TokenSlots`: one token cannot take every slot of
a gateway), and 403 when a token without the grant pins a pool (`check_pool_pin`): pinned
requests choose which version serves them, so a client free to pin could feed the rollout
analysis what it likes.

"Revoked" is what the gateway can know: a token whose secret matches a client that an earlier
routing table of this process listed and the current one does not (revoked or deleted). After a
restart such a token is "unknown".
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable

from gateway.errors import ClientTokenRefused, Refusal
from gateway.routes import ClientGrant, RoutingTable
from protocol.logs import RefusalReason
from protocol.tokens import hash_secret, key_id_of

_NO_HASH = "0" * 64
_HOW = (
    "send `Authorization: Bearer dctl_...` with a client token "
    "(`dctl token create NAME --role client`)"
)


def _unauthorized(
    message: str, token: str, key_id: str, reason: RefusalReason
) -> ClientTokenRefused:
    return ClientTokenRefused(401, message, Refusal(token, key_id, reason), code="invalid_api_key")


def _refused(grant: ClientGrant, reason: RefusalReason) -> Refusal:
    return Refusal(grant.name, grant.key_id, reason)


def authenticate(authorization: bytes | None, table: RoutingTable, now: float) -> ClientGrant:
    """The client whose token AUTHORIZATION (`Bearer dctl_...`) carries; NOW is epoch seconds."""
    if not authorization:
        raise _unauthorized(f"missing API key: {_HOW}", "", "", "unknown")
    scheme, _, value = authorization.decode("latin-1").partition(" ")
    secret = value.strip()
    if scheme.lower() != "bearer" or not secret:
        raise _unauthorized(f"malformed Authorization header: {_HOW}", "", "", "unknown")
    key_id = key_id_of(secret) or ""
    grant = table.clients.get(key_id) if key_id else None
    former = table.former_clients.get(key_id) if key_id and grant is None else None
    digest = hash_secret(secret)
    # Compared even when the key id is unknown, so that timing says nothing about which exist.
    known = grant or former
    matches = hmac.compare_digest(digest, known.secret_sha256 if known else _NO_HASH)
    if former is not None and matches:
        raise _unauthorized(
            f"API key {key_id} ({former.name}) is no longer valid (revoked or deleted); ask "
            "for a new one",
            former.name, key_id, "revoked",
        )  # fmt: skip
    if grant is None or not matches:
        # A known key id with a wrong secret counts against that token: someone is guessing.
        raise _unauthorized(
            f"invalid API key: not a client token this gateway knows; {_HOW}",
            grant.name if grant else "", key_id, "unknown",
        )  # fmt: skip
    if grant.expires_at is not None and now >= grant.expires_at:
        raise _unauthorized(
            f"API key {grant.key_id} ({grant.name}) has expired; ask for a new one",
            grant.name, key_id, "expired",
        )  # fmt: skip
    return grant


def check_pool_pin(grant: ClientGrant) -> None:
    """Refuse with a 403 unless GRANT may pin a request's pool (`x-dctl-pool`)."""
    if not grant.allow_pool_pin:
        raise ClientTokenRefused(
            403,
            f"API key {grant.key_id} ({grant.name}) may not pin a pool (x-dctl-pool): leave the "
            "header out, or use a client token created with "
            "`dctl token create NAME --role client --allow-pool-pin`",
            _refused(grant, "forbidden"),
            param="x-dctl-pool",
            code="pool_pin_not_allowed",
        )


def check_scope(grant: ClientGrant, deployment: str) -> None:
    """Refuse with a 403 unless GRANT's scope includes DEPLOYMENT."""
    if not grant.may_use(deployment):
        raise ClientTokenRefused(
            403,
            f"API key {grant.key_id} ({grant.name}) may not use deployment {deployment}; it may "
            "use: " + (", ".join(sorted(grant.deployments or ())) or "none"),
            _refused(grant, "forbidden"),
            param="model",
            code="model_not_allowed",
        )


class TokenSlots:
    """Requests in flight per client key id, each token capped at its own `max_concurrency` or
    else at DEFAULT_CAP."""

    def __init__(self, default_cap: int) -> None:
        self.default_cap = default_cap
        self._inflight: dict[str, int] = {}  # key id -> requests in flight (absent: none)

    def take(self, grant: ClientGrant) -> None:
        """Take one slot for GRANT's token, or raise a 429 naming its cap and how to change it."""
        cap = grant.max_concurrency or self.default_cap
        held = self._inflight.get(grant.key_id, 0)
        if held >= cap:
            raise ClientTokenRefused(
                429,
                f"API key {grant.key_id} ({grant.name}) already has {held} requests in flight at "
                f"this gateway, its limit of {cap} (the token's --max-concurrency, else the "
                "gateway's max_concurrency_per_token); wait for one to finish, or ask an admin "
                "for a token with a higher cap: `dctl token create NAME --role client "
                "--max-concurrency N`",
                _refused(grant, "rate_limited"),
                code="concurrency_limit_exceeded",
                headers={"retry-after": "1"},
            )
        self._inflight[grant.key_id] = held + 1

    def give_back(self, key_id: str) -> None:
        """Free one slot of KEY_ID's token."""
        held = self._inflight.pop(key_id, 0) - 1
        if held > 0:
            self._inflight[key_id] = held

    def held(self, key_id: str) -> int:
        """Requests in flight for KEY_ID's token."""
        return self._inflight.get(key_id, 0)


class RateLimiter:
    """A token bucket per client key id: RATE requests/s on average, bursts up to BURST.

    CLOCK is monotonic seconds. A RATE of 0 admits everything.
    """

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = float(burst)
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # key id -> (tokens, at)

    def admit(self, grant: ClientGrant) -> None:
        """Take one request from GRANT's bucket, or raise a 429 saying when to retry."""
        if self.rate <= 0:
            return
        key_id = grant.key_id
        now = self._clock()
        tokens, at = self._buckets.get(key_id, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key_id] = (tokens, now)
            wait = max(1, math.ceil((1.0 - tokens) / self.rate))
            raise ClientTokenRefused(
                429,
                f"rate limit of {self.rate:g} requests/s (bursts of {self.burst:g}) reached for "
                f"API key {key_id}; retry after {wait} s",
                _refused(grant, "rate_limited"),
                code="rate_limit_exceeded",
                headers={"retry-after": str(wait)},
            )
        self._buckets[key_id] = (tokens - 1.0, now)

    def retain(self, key_ids: set[str]) -> None:
        """Forget the buckets of tokens no longer in the routing table."""
        for key_id in [k for k in self._buckets if k not in key_ids]:
            del self._buckets[key_id]
