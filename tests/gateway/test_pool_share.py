"""The split clients see (`dctl_gateway_pool_share`): each pool's share of its deployment's
requests over the last minute, a starved canary included."""

from __future__ import annotations

import pytest

from gateway.pool_share import WINDOW_S, PoolShares
from tests.clock import FakeClock
from tests.gateway.conftest import ENGINES, LiveGateway

SHARE = "dctl_gateway_pool_share"


def test_shares_split_each_deployment_by_pool() -> None:
    clock = FakeClock()
    shares = PoolShares(clock.monotonic)
    for _ in range(9):
        shares.count("chat", "stable")
    shares.count("chat", "canary")
    shares.count("embed", "stable")
    assert shares.shares() == {
        ("chat", "canary"): pytest.approx(0.1),
        ("chat", "stable"): pytest.approx(0.9),
        ("embed", "stable"): 1.0,
    }


def test_a_routed_pool_that_served_nothing_shows_zero_and_an_idle_deployment_nothing() -> None:
    clock = FakeClock()
    shares = PoolShares(clock.monotonic)
    shares.count("chat", "stable")
    routed = [("chat", "stable"), ("chat", "canary"), ("idle", "stable"), ("idle", "canary")]
    assert shares.shares(routed) == {("chat", "canary"): 0.0, ("chat", "stable"): 1.0}


def test_requests_older_than_the_window_leave_it() -> None:
    clock = FakeClock()
    shares = PoolShares(clock.monotonic)
    for _ in range(3):
        shares.count("chat", "canary")
    clock.advance(WINDOW_S / 2)
    shares.count("chat", "stable")
    assert shares.requests() == {("chat", "canary"): 3, ("chat", "stable"): 1}
    clock.advance(WINDOW_S / 2 + 5)  # the canary's requests are over a minute old now
    assert shares.shares() == {("chat", "stable"): 1.0}
    clock.advance(WINDOW_S)
    assert shares.shares() == {}


def test_a_failing_canary_the_gateway_ejects_shows_starved_in_the_gauge(
    gateway: LiveGateway,
) -> None:
    # Weight 50, but the canary answers 500: after 3 failures passive health ejects it for 10 s
    # and its requests go to stable. Clients saw far less canary than the weight says.
    for _ in range(60):
        gateway.post("starved-model")
    metrics = gateway.metrics()
    served = metrics[f"{SHARE}{{deployment=starved,pool=canary}}"]
    assert 0 < served < 0.25  # its 3 failures before the ejection: far below half its weight
    assert metrics[f"{SHARE}{{deployment=starved,pool=stable}}"] == pytest.approx(1 - served)
    assert gateway.gateway.balancer.is_ejected(ENGINES["l"][0])
