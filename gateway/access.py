"""Who may send requests: client tokens checked against the routing table, and per-token rates.

Client tokens are control-plane tokens of role `client`: `dctl_<key id>_<random>`. The routing
table carries each one's SHA-256, scope and expiry, never the secret; a request's token is
hashed and compared in constant time. A revoked token leaves the table, so it stops working
within one routing poll.

Every refusal is a `GatewayError`: 401 for a missing, malformed, unknown or expired token, 429
with `Retry-After` when a token spends its rate (a token bucket per key id) or has as many
requests in flight as it may (`TokenSlots`: one token cannot take every slot of a gateway), and
403 when a token without the grant pins a pool (`check_pool_pin`): pinned requests choose which
version serves them, so a client free to pin could feed the rollout analysis what it likes.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Callable

from gateway.errors import GatewayError
from gateway.routes import ClientGrant, RoutingTable
from protocol.tokens import hash_secret, key_id_of

_NO_HASH = "0" * 64
_HOW = (
    "send `Authorization: Bearer dctl_...` with a client token "
    "(`dctl token create NAME --role client`)"
)


def _unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, code="invalid_api_key")


def authenticate(authorization: bytes | None, table: RoutingTable, now: float) -> ClientGrant:
    """The client whose token AUTHORIZATION (`Bearer dctl_...`) carries; NOW is epoch seconds."""
    if not authorization:
        raise _unauthorized(f"missing API key: {_HOW}")
    scheme, _, value = authorization.decode("latin-1").partition(" ")
    secret = value.strip()
    if scheme.lower() != "bearer" or not secret:
        raise _unauthorized(f"malformed Authorization header: {_HOW}")
    key_id = key_id_of(secret)
    grant = table.clients.get(key_id) if key_id else None
    digest = hash_secret(secret)
    # Compared even when the key id is unknown, so that timing says nothing about which exist.
    matches = hmac.compare_digest(digest, grant.secret_sha256 if grant else _NO_HASH)
    if grant is None or not matches:
        raise _unauthorized(f"invalid API key: not a client token this gateway knows; {_HOW}")
    if grant.expires_at is not None and now >= grant.expires_at:
        raise _unauthorized(f"API key {grant.key_id} ({grant.name}) has expired; ask for a new one")
    return grant


def check_pool_pin(grant: ClientGrant) -> None:
    """Refuse with a 403 unless GRANT may pin a request's pool (`x-dctl-pool`)."""
    if not grant.allow_pool_pin:
        raise GatewayError(
            403,
            f"API key {grant.key_id} ({grant.name}) may not pin a pool (x-dctl-pool): leave the "
            "header out, or use a client token created with "
            "`dctl token create NAME --role client --allow-pool-pin`",
            param="x-dctl-pool",
            code="pool_pin_not_allowed",
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
            raise GatewayError(
                429,
                f"API key {grant.key_id} ({grant.name}) already has {held} requests in flight at "
                f"this gateway, its limit of {cap} (the token's --max-concurrency, else the "
                "gateway's max_concurrency_per_token); wait for one to finish, or ask an admin "
                "for a token with a higher cap: `dctl token create NAME --role client "
                "--max-concurrency N`",
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

    def admit(self, key_id: str) -> None:
        """Take one request from KEY_ID's bucket, or raise a 429 saying when to retry."""
        if self.rate <= 0:
            return
        now = self._clock()
        tokens, at = self._buckets.get(key_id, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key_id] = (tokens, now)
            wait = max(1, math.ceil((1.0 - tokens) / self.rate))
            raise GatewayError(
                429,
                f"rate limit of {self.rate:g} requests/s (bursts of {self.burst:g}) reached for "
                f"API key {key_id}; retry after {wait} s",
                code="rate_limit_exceeded",
                headers={"retry-after": str(wait)},
            )
        self._buckets[key_id] = (tokens - 1.0, now)

    def retain(self, key_ids: set[str]) -> None:
        """Forget the buckets of tokens no longer in the routing table."""
        for key_id in [k for k in self._buckets if k not in key_ids]:
            del self._buckets[key_id]
