"""The compiled routing table and the watcher that keeps it current from a route source."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

import pytest

from client.errors import ClientError
from gateway.routes import Routes, RouteWatcher, RoutingTable
from protocol.gateway import RouteTable


def _table(etag: str, weight: int = 0) -> RouteTable:
    instance = {"id": 1, "host": "h1", "address": "::1", "port": 9000, "scheme": "https",
                "api_key": "dctl_ik_secret"}  # fmt: skip
    return RouteTable.model_validate(
        {
            "etag": etag,
            "deployments": [
                {
                    "deployment": "chat",
                    "model_names": ["chat", "chat-latest"],
                    "stable": {"version_id": 1, "version": "m:1", "instances": [instance]},
                    "canary": {"version_id": 2, "version": "m:2", "instances": []},
                    "canary_weight": weight,
                },
                {
                    "deployment": "other",
                    "model_names": ["other", "chat"],
                    "stable": {"version_id": 3, "version": "o:1"},
                },
            ],
            "clients": [
                {
                    "key_id": "abcdefabcdef",
                    "name": "app",
                    "secret_sha256": "AB" * 32,
                    "deployments": ["chat"],
                    "expires_at": datetime(2030, 1, 1, tzinfo=UTC),
                },
            ],
        }
    )


class Source:
    """Stands in for the control plane's `GET /api/v1/routes` (304 while the ETag holds)."""

    def __init__(self, table: RouteTable) -> None:
        self.table = table
        self.down = False
        self.asked_with: list[str | None] = []

    async def routes(self, etag: str | None = None) -> RouteTable | None:
        self.asked_with.append(etag)
        if self.down:
            raise ClientError("cannot reach the control plane at http://cp:8700")
        return None if etag == self.table.etag else self.table


def test_a_table_compiles_to_lookups() -> None:
    compiled = RoutingTable.compile(_table("1", weight=30))
    route = compiled.by_model["chat-latest"]
    assert route is compiled.by_model["chat"]  # the first deployment listed keeps the name
    assert compiled.by_model["other"].deployment == "other"
    (instance,) = route.stable.instances
    assert instance.host_header == b"[::1]:9000"
    assert instance.target == ("https", "::1", 9000)
    assert instance.authorization == b"Bearer dctl_ik_secret"
    assert "dctl_ik_secret" not in repr(instance)
    assert route.canary is not None and route.canary_weight == 30
    # Windows are reported by the version's id; clients see MODEL:VERSION.
    assert (route.stable.version_id, route.stable.version_header) == (1, b"m:1")
    assert (route.canary.version_id, route.canary.version_header) == (2, b"m:2")
    grant = compiled.clients["abcdefabcdef"]
    assert grant.secret_sha256 == "ab" * 32
    assert grant.expires_at == datetime(2030, 1, 1, tzinfo=UTC).timestamp()
    assert compiled.models_for(grant) == ["chat", "chat-latest"]
    assert compiled.instance_ids() == {1}


def test_the_watcher_installs_changes_and_sends_its_etag() -> None:
    source = Source(_table("1"))
    installed: list[str] = []
    routes = Routes(on_install=lambda t: installed.append(t.etag))
    watcher = RouteWatcher(source, routes, poll_s=1.0)
    assert asyncio.run(watcher.poll_once())
    assert not asyncio.run(watcher.poll_once())  # 304: nothing to do
    source.table = _table("2", weight=50)
    assert asyncio.run(watcher.poll_once())
    assert source.asked_with == [None, "1", "1"]
    assert installed == ["1", "2"]
    assert routes.current is not None and routes.current.by_model["chat"].canary_weight == 50


def test_the_last_table_serves_through_an_outage_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = Source(_table("1"))
    routes = Routes()
    watcher = RouteWatcher(source, routes, poll_s=1.0)
    asyncio.run(watcher.poll_once())
    source.down = True
    with caplog.at_level(logging.INFO, logger="dctl.gateway.routes"):
        for _ in range(5):
            assert not asyncio.run(watcher.poll_once())
        assert routes.current is not None and routes.current.etag == "1"
        source.down = False
        asyncio.run(watcher.poll_once())
    messages = [r.getMessage() for r in caplog.records]
    (outage,) = [m for m in messages if "cannot read routes" in m]
    assert "serving the last table (1)" in outage
    assert any("readable again after 5 failed polls" in m for m in messages)


def test_the_watcher_runs_until_cancelled() -> None:
    source = Source(_table("1"))
    routes = Routes()

    async def scenario() -> None:
        task = asyncio.create_task(RouteWatcher(source, routes, poll_s=0.01).run())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert routes.current is not None and len(source.asked_with) > 3
