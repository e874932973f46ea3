"""The balancer's rules, with a fake clock and a seeded random source: no server, no sleeping."""

from __future__ import annotations

import random

import pytest

from gateway.balancer import EJECT_MAX_S, Balancer
from gateway.routes import Instance, Route, RoutingTable
from protocol.gateway import RouteTable
from tests.clock import FakeClock


def _table(weight: int = 20, stable: int = 2, canary: int = 1) -> RoutingTable:
    def pool(version_id: int, first_id: int, n: int) -> dict[str, object]:
        instances = [
            {"id": first_id + i, "host": "h", "address": "10.0.0.1", "port": 8000 + first_id + i,
             "api_key": "k"}
            for i in range(n)
        ]  # fmt: skip
        return {"version_id": version_id, "version": f"m:{version_id}", "instances": instances}

    return RoutingTable.compile(
        RouteTable.model_validate(
            {
                "etag": "1",
                "deployments": [
                    {
                        "deployment": "d",
                        "model_names": ["m"],
                        "stable": pool(1, 1, stable),
                        "canary": pool(2, 100, canary),
                        "canary_weight": weight,
                    },
                ],
            }
        )
    )


def _route(**kwargs: int) -> Route:
    return _table(**kwargs).routes[0]


def _balancer(clock: FakeClock | None = None, seed: int = 7) -> tuple[Balancer, list[Instance]]:
    ejected: list[Instance] = []
    balancer = Balancer(
        (clock or FakeClock()).monotonic, random.Random(seed), lambda i, s: ejected.append(i)
    )
    return balancer, ejected


def test_the_canary_gets_its_weight() -> None:
    balancer, _ = _balancer()
    route = _route(weight=20)
    firsts = [balancer.pool_order(route)[0].name for _ in range(10_000)]
    assert 0.18 < firsts.count("canary") / len(firsts) < 0.22
    assert {balancer.pool_order(_route(weight=0))[0].name for _ in range(200)} == {"stable"}
    assert {balancer.pool_order(_route(weight=100))[0].name for _ in range(200)} == {"canary"}


def test_the_other_pool_is_the_fallback_and_a_pin_has_none() -> None:
    balancer, _ = _balancer()
    route = _route(weight=0)
    assert [p.name for p in balancer.pool_order(route)] == ["stable", "canary"]
    assert [p.name for p in balancer.pool_order(route, "canary")] == ["canary"]
    no_canary = _route(canary=0)
    empty = balancer.pick(balancer.pool_order(no_canary, "canary"))
    assert empty is None
    # The stable pool has nothing usable: the canary serves.
    for instance in route.stable.instances:
        for _ in range(3):
            balancer.failed(instance)
    picked = balancer.pick(balancer.pool_order(route))
    assert picked is not None and picked[0].name == "canary"


def test_least_outstanding_wins_and_ties_are_random() -> None:
    balancer, _ = _balancer()
    route = _route(stable=3)
    a, b, c = route.stable.instances
    balancer.started(a)
    balancer.started(b)
    assert balancer.pick((route.stable,)) == (route.stable, c)
    balancer.finished(a)
    chosen = {balancer.pick((route.stable,))[1].id for _ in range(100)}  # type: ignore[index]
    assert chosen == {a.id, c.id}
    assert balancer.pick((route.stable,), exclude=(a.id, c.id)) == (route.stable, b)


def test_three_failures_eject_for_10s_doubling_to_120s_and_a_success_resets() -> None:
    clock = FakeClock()
    balancer, ejected = _balancer(clock)
    route = _route(stable=2)
    bad, good = route.stable.instances
    assert not balancer.failed(bad) and not balancer.failed(bad)
    assert balancer.failed(bad) and ejected == [bad]
    assert balancer.pick((route.stable,)) == (route.stable, good)
    clock.advance(9.9)
    assert balancer.is_ejected(bad.id)
    clock.advance(0.2)
    assert not balancer.is_ejected(bad.id)
    # On probation: the next failure ejects again, for twice as long, up to the cap.
    lengths = []
    for _ in range(6):
        assert balancer.failed(bad)
        start = clock.monotonic()
        while balancer.is_ejected(bad.id):
            clock.advance(1)
        lengths.append(round(clock.monotonic() - start))
    assert lengths == [20, 40, 80, 120, 120, 120]
    assert max(lengths) == EJECT_MAX_S
    balancer.succeeded(bad)
    assert not balancer.failed(bad) and not balancer.failed(bad)


def test_failures_of_requests_already_in_flight_do_not_extend_an_ejection() -> None:
    clock = FakeClock()
    balancer, ejected = _balancer(clock)
    bad = _route().stable.instances[0]
    for _ in range(3):
        balancer.failed(bad)
    for _ in range(5):
        assert not balancer.failed(bad)
    assert len(ejected) == 1
    clock.advance(10.1)
    assert not balancer.is_ejected(bad.id)


def test_instance_state_survives_a_table_swap_and_leaves_with_its_instance() -> None:
    balancer, _ = _balancer()
    bad = _route().stable.instances[0]
    for _ in range(3):
        balancer.failed(bad)
    swapped = _table(weight=50)  # a new table, the same instances
    assert balancer.is_ejected(bad.id)
    balancer.retain(swapped.instance_ids())
    assert balancer.is_ejected(bad.id)
    balancer.retain(set())
    assert not balancer.is_ejected(bad.id)


@pytest.mark.parametrize("weight", [1, 50, 99])
def test_any_weight_reaches_both_pools(weight: int) -> None:
    balancer, _ = _balancer()
    route = _route(weight=weight)
    names = {balancer.pool_order(route)[0].name for _ in range(2000)}
    assert names == {"stable", "canary"}


def test_with_every_instance_ejected_the_first_to_recover_is_tried_and_a_success_heals_it() -> None:
    # A rolling restart of two instances: the first is ejected for its downtime and already
    # serves again when the second goes down and is ejected too.
    clock = FakeClock()
    balancer, _ = _balancer(clock)
    route = _route(stable=2, canary=0)
    first, second = route.stable.instances
    for _ in range(3):
        balancer.failed(first)
    clock.advance(4)
    for _ in range(3):
        balancer.failed(second)
    assert balancer.is_ejected(first.id) and balancer.is_ejected(second.id)
    assert balancer.pick(balancer.pool_order(route)) == (route.stable, first)
    assert balancer.pick((route.stable,), exclude=(first.id,)) == (route.stable, second)
    balancer.succeeded(first)
    assert not balancer.is_ejected(first.id) and balancer.is_ejected(second.id)
    # An empty pool is still nothing to pick.
    assert balancer.pick(balancer.pool_order(_route(stable=0, canary=0))) is None
