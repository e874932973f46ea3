"""`GET /health`, the probe vLLM and SGLang answer and benchmark clients check first: 200 when
the gateway could serve a request now, else 503 with the reason."""

from __future__ import annotations

import json
from pathlib import Path

from gateway import GatewaySettings
from tests.gateway.canned_engine import refused_port
from tests.gateway.conftest import Fleet, LiveGateway, served


def test_health_is_200_with_a_routing_table_and_a_ready_instance(gateway: LiveGateway) -> None:
    health = gateway.http.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "routes": "test-1"}
    # The finer probes stay as they were.
    assert gateway.http.get("/health/live").status_code == 200
    assert gateway.http.get("/health/ready").status_code == 200


def test_health_is_503_without_a_ready_instance(fleet: Fleet, tmp_path: Path) -> None:
    table = json.loads(fleet.routes_file.read_text())
    table["deployments"] = [d for d in table["deployments"] if d["deployment"] == "empty"]
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps(table))
    with served(GatewaySettings(routes_file=routes, port=0), fleet) as live:
        health = live.http.get("/health")
        assert health.status_code == 503
        assert health.json()["reason"] == "no deployment has a ready instance"
        # It has a table, so it is ready in /health/ready's sense: it answers every request.
        assert live.http.get("/health/ready").status_code == 200


def test_health_is_503_before_the_first_routing_table(fleet: Fleet) -> None:
    settings = GatewaySettings(
        control_plane=f"http://127.0.0.1:{refused_port()}", token="dctl_gw_token", port=0,
        routes_poll_s=60,
    )  # fmt: skip
    with served(settings, fleet) as live:
        health = live.http.get("/health")
        assert health.status_code == 503
        assert health.json()["reason"] == "no routing table yet"
