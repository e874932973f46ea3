"""Threat: a caller holding a host's agent token (or a bootstrap token) registers one host name in
a loop; every registration revokes and mints tokens, writes events and re-plans the fleet.

A host name may register 5 times back to back, then once per 10 s; past that it gets 429 with
Retry-After (the usual JSON error) before anything is written. Registrations refused for other
reasons (403, 409) spend nothing, so another caller cannot use up the real agent's allowance;
other host names are not affected, and the table of names is bounded.

Against a real control plane on loopback (SQLite and PostgreSQL).
"""

# Fixtures imported from tests/controlplane and live_controlplane are named again by the tests.
# ruff: noqa: F401, F811

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from controlplane.heartbeat.rate_limit import (
    REGISTER_BURST,
    REGISTER_REFILL_S,
    RegisterTooSoon,
    RegistrationRateLimit,
)
from tests.controlplane.conftest import db_url, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, live


def reregister(live: LiveControlPlane, name: str, token: str) -> tuple[int, str]:
    """Register `name` again with `token`: the status, and the new token (or the old one)."""
    response = live.call("POST", f"{V}/agents/register", token, json={"name": name})
    if response.status_code == 200:
        return 200, str(response.json()["agent_token"])
    return response.status_code, token


def test_a_host_registering_in_a_loop_gets_429_with_retry_after_before_any_write(
    live: LiveControlPlane,
) -> None:
    token = live.register("gpu-1")  # the first of its burst
    calm = live.register("gpu-2")
    # The clock stands still: nothing refills the bucket.
    for _ in range(REGISTER_BURST - 1):
        status, token = reregister(live, "gpu-1", token)
        assert status == 200
    assert live.heartbeat(token).status_code == 200  # its last use is recorded (once a minute)
    tokens_before, events_before = live.tokens(), live.call("GET", f"{V}/events", live.admin).json()
    limited = live.call("POST", f"{V}/agents/register", token, json={"name": "gpu-1"})
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"] == "rate_limited" and "gpu-1" in limited.json()["message"]
    assert limited.headers["retry-after"] == str(int(REGISTER_REFILL_S))
    # Nothing written (authenticating it wrote no last use: that is done once a minute): the
    # token still works, no token minted or revoked, no event.
    assert live.tokens() == tokens_before
    assert live.call("GET", f"{V}/events", live.admin).json() == events_before
    assert live.heartbeat(token).status_code == 200
    # Other hosts are not affected; the limited one may register again once the bucket refills.
    assert reregister(live, "gpu-2", calm)[0] == 200
    live.clock.advance(REGISTER_REFILL_S)
    status, token = reregister(live, "gpu-1", token)
    assert status == 200
    assert reregister(live, "gpu-1", token)[0] == 429


def test_refused_registrations_do_not_use_up_the_real_agents_allowance(
    live: LiveControlPlane,
) -> None:
    token = live.register("gpu-1")
    other = live.register("gpu-2")
    bootstrap = live.token("bootstrap")
    for _ in range(3 * REGISTER_BURST):
        # A bootstrap token naming a registered host (409), another host's token (403), and no
        # valid token at all (401): none of them spends gpu-1's registrations.
        assert reregister(live, "gpu-1", bootstrap)[0] == 409
        assert reregister(live, "gpu-1", other)[0] == 403
        assert reregister(live, "gpu-1", "dctl_nope_nope")[0] == 401
    for _ in range(REGISTER_BURST - 1):
        status, token = reregister(live, "gpu-1", token)
        assert status == 200


def test_the_table_of_registering_names_is_bounded() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    limits = RegistrationRateLimit(burst=1, refill_s=10, max_names=3)
    for n in range(10):
        limits.admit(f"host-{n}", now)
    assert len(limits) == 3
    with pytest.raises(RegisterTooSoon) as raised:
        limits.admit("host-9", now)
    assert raised.value.retry_after_s == 10
