"""Threat: Prometheus sent where an agent, or whoever asks for the targets, says.

`GET /api/v1/metrics/targets` is what a Prometheus scrapes, from inside the network. An agent's
reported `metrics_url` was published with any host, port and path (169.254.169.254 was
accepted), and the control plane's own target was built from the request's Host header. Now an
agent's target must be on its host's advertise address, at the agent's metrics path, on a port
that is not one of the host's engine ports; the control plane's own target is its configured
`public_url` (default: the bind).

Every test talks to a real control plane on loopback (`live_controlplane`, SQLite and
PostgreSQL).
"""

# Fixtures imported from tests/controlplane are named again by the tests that use them.
# ruff: noqa: F401, F811

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.settings import SettingsError, load_controlplane_settings
from tests.controlplane.conftest import db_url, pg_url, sqlite_template
from tests.security.live_controlplane import LiveControlPlane, V, serve

ADVERTISED = "10.0.0.5"


@pytest.fixture
def live(db_url: str) -> Iterator[LiveControlPlane]:
    """A control plane whose public URL is https://cp.example.net."""
    yield from serve(db_url, public_url="https://cp.example.net")


def targets(live: LiveControlPlane, role: str, **headers: str) -> list[dict[str, Any]]:
    response = live.call("GET", f"{V}/metrics/targets", live.admin, headers=headers)
    assert response.status_code == 200, response.text
    return [g for g in response.json() if g["labels"]["role"] == role]


def test_an_agent_cannot_point_prometheus_anywhere_else(live: LiveControlPlane) -> None:
    boot = live.token("bootstrap")
    body = {"name": "gpu-1", "advertise_address": ADVERTISED, "port_range": [18000, 18099]}
    agent = live.call("POST", f"{V}/agents/register", boot, json=body).json()["agent_token"]

    def report(url: str) -> list[dict[str, Any]]:
        beat = {"advertise_address": ADVERTISED, "facts": {"metrics_url": url}}
        assert live.heartbeat(agent, **beat).status_code == 200
        return targets(live, "agent")

    for forged in (
        "http://169.254.169.254:80/metrics",  # cloud metadata
        "http://127.0.0.1:8700/metrics",  # whatever listens beside Prometheus
        f"http://{ADVERTISED}:9401/latest/meta-data/iam",  # another path
        f"http://{ADVERTISED}:18007/metrics",  # an engine's port, not the agent's
    ):
        assert report(forged) == [], forged
    [own] = report(f"http://{ADVERTISED}:9401/metrics")
    assert own["targets"] == [f"{ADVERTISED}:9401"]
    assert own["labels"]["__metrics_path__"] == "/metrics"


def test_the_control_plane_target_is_its_public_url_not_the_host_header(
    live: LiveControlPlane,
) -> None:
    for host in (None, "169.254.169.254", "127.0.0.1:22"):
        headers = {"Host": host} if host else {}
        assert targets(live, "controlplane", **headers) == [
            {"targets": ["cp.example.net:443"],
             "labels": {"role": "controlplane", "__scheme__": "https",
                        "__metrics_path__": "/metrics"}}
        ]  # fmt: skip


def test_public_url_is_checked_and_defaults_to_the_bind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # no config file of this machine's
    for name in ("DCTL_CONFIG", "DCTL_PUBLIC_URL"):
        monkeypatch.delenv(name, raising=False)
    bound = load_controlplane_settings(host="0.0.0.0", port=9000)
    assert bound.resolved_public_url() == "http://127.0.0.1:9000"
    named = load_controlplane_settings(public_url="https://cp.example.net:8700/")
    assert named.resolved_public_url() == "https://cp.example.net:8700"
    for bad in ("cp.example.net", "ftp://cp", "https://cp/metrics", "https://u:p@cp"):
        with pytest.raises(SettingsError, match="public_url"):
            load_controlplane_settings(public_url=bad)
