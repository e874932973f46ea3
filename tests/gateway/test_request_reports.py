"""Token refusals by reason (unknown, expired, revoked, rate limited, forbidden) and, through a
live gateway reporting to a stand-in control plane, the request summaries, token usage and
refusals its traffic reports carry."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from gateway import GatewaySettings
from gateway.access import RateLimiter, TokenSlots, authenticate, check_pool_pin, check_scope
from gateway.errors import ClientTokenRefused, Refusal
from gateway.routes import MAX_FORMER_CLIENTS, ClientGrant, Routes
from protocol.gateway import RouteTable, TrafficAccepted, TrafficReport
from protocol.logs import TokenUsage
from tests.gateway.conftest import Fleet, LiveGateway, mint_token, served, until

NOW = datetime(2026, 1, 1, tzinfo=UTC).timestamp()


def client(name: str, secret: str, **more: Any) -> dict[str, Any]:
    return {"key_id": secret.split("_")[1], "name": name,
            "secret_sha256": hashlib.sha256(secret.encode()).hexdigest(), **more}  # fmt: skip


def table(*clients: dict[str, Any]) -> RouteTable:
    return RouteTable(etag=f"t-{time.monotonic_ns()}", clients=clients)  # type: ignore[arg-type]


def refusal(call: Callable[[], object]) -> Refusal:
    with pytest.raises(ClientTokenRefused) as refused:
        call()
    return refused.value.refusal


def test_a_refusal_says_whose_token_and_why() -> None:
    (app_id, app), (old_id, old), (gone_id, gone) = mint_token(), mint_token(), mint_token()
    routes = Routes()
    routes.install(table(client("app", app), client("old", old), client("gone", gone)))
    routes.install(table(client("app", app, expires_at=NOW - 1)))
    current = routes.current
    assert current is not None

    def auth(value: bytes | None) -> Callable[[], object]:
        return lambda: authenticate(value, current, NOW)

    assert refusal(auth(None)) == Refusal("", "", "unknown")
    assert refusal(auth(b"Basic abc")) == Refusal("", "", "unknown")
    assert refusal(auth(b"Bearer sk-not-ours")) == Refusal("", "", "unknown")
    assert refusal(auth(f"Bearer {app}".encode())) == Refusal("app", app_id, "expired")
    # A known key id with a wrong secret counts against that token: someone is guessing it.
    assert refusal(auth(f"Bearer {app}x".encode())) == Refusal("app", app_id, "unknown")
    # Listed by an earlier table, not by this one: revoked (or deleted), with the right secret.
    assert refusal(auth(f"Bearer {old}".encode())) == Refusal("old", old_id, "revoked")
    assert refusal(auth(f"Bearer {gone}".encode())) == Refusal("gone", gone_id, "revoked")
    with pytest.raises(ClientTokenRefused, match="no longer valid"):
        auth(f"Bearer {old}".encode())()
    assert refusal(auth(f"Bearer {old}x".encode())) == Refusal("", old_id, "unknown")
    # Listed again, it works again; a table later it is still remembered as gone.
    routes.install(table(client("old", old)))
    assert authenticate(f"Bearer {old}".encode(), routes.current, NOW).name == "old"  # type: ignore[arg-type]
    assert set(routes.current.former_clients) == {app_id, gone_id}  # type: ignore[union-attr]


def test_tokens_gone_are_remembered_within_a_bound() -> None:
    routes = Routes()
    for n in range(3):
        routes.install(table(*(client(f"t{n}-{i}", mint_token()[1]) for i in range(2000))))
    routes.install(table())
    assert routes.current is not None
    assert len(routes.current.former_clients) == MAX_FORMER_CLIENTS
    assert next(iter(routes.current.former_clients.values())).name.startswith("t0-")


def test_rates_concurrency_and_grants_refuse_as_their_reasons() -> None:
    grant = ClientGrant("aaaaaaaaaaaa", "app", "0" * 64, frozenset({"chat"}), None)
    limiter = RateLimiter(1.0, 1, lambda: 0.0)
    limiter.admit(grant)
    assert refusal(lambda: limiter.admit(grant)) == Refusal("app", grant.key_id, "rate_limited")
    slots = TokenSlots(default_cap=1)
    slots.take(grant)
    assert refusal(lambda: slots.take(grant)).reason == "rate_limited"
    assert refusal(lambda: check_scope(grant, "code")).reason == "forbidden"
    assert refusal(lambda: check_pool_pin(grant)).reason == "forbidden"
    check_scope(grant, "chat")


# --- through a live gateway ----------------------------------------------------------------------


class ReportedControlPlane:
    """Stands in for the control plane: the fleet's routing table (the test may replace its
    clients), and the traffic reports posted."""

    def __init__(self, fleet: Fleet) -> None:
        self.base = json.loads(fleet.routes_file.read_text())
        self.table = RouteTable.model_validate(self.base)
        self.reports: list[TrafficReport] = []

    def without(self, name: str) -> None:
        """Serve a table that no longer lists client NAME (revoked)."""
        clients = [c for c in self.base["clients"] if c["name"] != name]
        self.table = RouteTable.model_validate({**self.base, "clients": clients, "etag": name})

    async def routes(self, etag: str | None = None) -> RouteTable | None:
        return None if etag == self.table.etag else self.table

    async def report_traffic(self, report: TrafficReport) -> TrafficAccepted:
        self.reports.append(report)
        return TrafficAccepted(accepted=len(report.windows))

    async def wake_deployment(self, name: str) -> None:
        pass

    async def aclose(self) -> None:
        pass


@pytest.fixture
def reporting(fleet: Fleet) -> Iterator[tuple[LiveGateway, ReportedControlPlane]]:
    link = ReportedControlPlane(fleet)
    settings = GatewaySettings(
        control_plane="http://cp.invalid:8700", token="dctl_gw_token", port=0,
        routes_poll_s=0.02, report_interval_s=0.1, summary_sample_rps=1000, rate_limit_rps=0.01,
        rate_limit_burst=5,
    )  # fmt: skip
    with served(settings, fleet, control_plane=link) as live:
        until(lambda: live.http.get("/health/ready").status_code == 200)
        yield live, link


def test_reports_carry_summaries_token_usage_and_refusals(
    reporting: tuple[LiveGateway, ReportedControlPlane],
) -> None:
    live, link = reporting
    ok = live.post("solo-model", headers={"x-request-id": "rep-ok"})
    failed = live.post("errors-model", canned="500", headers={"x-request-id": "rep-500"})
    assert (ok.status_code, failed.status_code) == (200, 500)
    assert live.post("solo-model", token="expired").status_code == 401
    assert live.post("solo-model", token="dctl_000000000000_" + "x" * 30).status_code == 401
    assert live.post("main-model", token="scoped").status_code == 403
    answers = [live.post("solo-model", token="many").status_code for _ in range(6)]
    assert answers == [200] * 5 + [429]  # bursts of 5
    link.without("pinner")
    until(lambda: live.gateway.routes.current is not None
           and live.gateway.routes.current.etag == "pinner")  # fmt: skip
    assert live.post("solo-model", token="pinner").status_code == 401

    def reported() -> tuple[list[Any], dict[tuple[str, str], int], list[TokenUsage]]:
        summaries = [s for r in link.reports for s in r.requests]
        refused: dict[tuple[str, str], int] = {}
        for r in (r for report in link.reports for r in report.refusals):
            refused[r.token, r.reason] = refused.get((r.token, r.reason), 0) + r.count
        return summaries, refused, [u for r in link.reports for u in r.usage]

    until(lambda: reported()[1].get(("pinner", "revoked")) == 1)
    summaries, refused, usage = reported()
    by_id = {s.request_id: s for s in summaries}
    assert (by_id["rep-ok"].status, by_id["rep-ok"].token, by_id["rep-ok"].deployment) == (
        200, "full", "solo",
    )  # fmt: skip
    assert by_id["rep-ok"].completion_tokens is not None
    assert (by_id["rep-500"].status, by_id["rep-500"].deployment) == (500, "errors")
    assert all(s.status not in (401, 403) for s in summaries)  # refusals are counted, not listed
    assert refused == {
        ("expired", "expired"): 1, ("", "unknown"): 1, ("scoped", "forbidden"): 1,
        ("many", "rate_limited"): 1, ("pinner", "revoked"): 1,
    }  # fmt: skip
    counted: dict[tuple[str, str], list[int]] = {}
    for u in usage:
        total = counted.setdefault((u.token, u.deployment), [0, 0])
        total[0] += u.requests
        total[1] += u.errors
    assert counted == {
        ("full", "solo"): [1, 0],
        ("full", "errors"): [1, 1],
        ("many", "solo"): [5, 0],
    }
