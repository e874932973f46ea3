"""The agent's own /metrics and its HTTP client for the control plane."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.control_plane import ControlPlaneLink
from agent.errors import ControlPlaneRejected, ControlPlaneUnavailable
from agent.gpu import FakeBackend
from agent.metrics import AgentMetrics
from protocol.wire import Heartbeat, HeartbeatReply


def test_gpu_gauges_in_base_units_skip_na_and_mark_lost_gpus() -> None:
    fake = FakeBackend("2xL4")
    fake.lose_gpu(1)
    metrics = AgentMetrics()
    metrics.gpus.sample = fake.sample()
    port = metrics.serve(0)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    samples = {
        (s.name, s.labels.get("gpu")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("dctl_gpu_memory_total_bytes", "0")] == 23034 * 1024 * 1024
    assert samples[("dctl_gpu_utilization_ratio", "0")] == 0.0
    assert samples[("dctl_gpu_up", "0")] == 1 and samples[("dctl_gpu_up", "1")] == 0
    assert ("dctl_gpu_memory_total_bytes", "1") not in samples  # N/A: no sample, not a zero
    assert any(name == "dctl_agent_snapshot_fetches_total" for name, _ in samples)


def _client(handler: httpx.MockTransport) -> ControlPlaneLink:
    return ControlPlaneLink("http://cp.test", client=httpx.Client(transport=handler))


def test_client_maps_answers_to_unavailable_or_rejected() -> None:
    reply = HeartbeatReply(generation=3, host_id=1, server_time=datetime.now(UTC))

    codes = iter([200, 503, 403])

    def routed(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == "Bearer tok"
        code = next(codes)
        if code == 200:
            return httpx.Response(200, content=reply.model_dump_json())
        body = {"error": "forbidden", "message": "this agent token is not bound to a host"}
        return httpx.Response(code, json=body)

    client = _client(httpx.MockTransport(routed))
    assert client.heartbeat(Heartbeat(), "tok").generation == 3
    with pytest.raises(ControlPlaneUnavailable, match="HTTP 503"):
        client.heartbeat(Heartbeat(), "tok")
    with pytest.raises(ControlPlaneRejected, match="not bound to a host") as info:
        client.heartbeat(Heartbeat(), "tok")
    assert info.value.status == 403


def test_unreachable_control_plane_is_unavailable_not_a_crash() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with pytest.raises(ControlPlaneUnavailable, match="connection refused"):
        _client(httpx.MockTransport(refuse)).heartbeat(Heartbeat(), "tok")


def test_the_metrics_url_names_the_bound_port_where_others_reach_it() -> None:
    from protocol.monitoring import metrics_url, split_metrics_url

    metrics = AgentMetrics()
    bound = metrics.serve(0)
    assert bound != 0
    url = metrics_url("http", "127.0.0.1", bound, "10.0.0.5")
    assert url == f"http://127.0.0.1:{bound}/metrics"  # bound to one address: that one
    assert "dctl_agent_heartbeats_total" in httpx.get(url, timeout=5).text
    # Bound to every interface: reached at the advertise address (IPv6 in brackets).
    assert metrics_url("https", "0.0.0.0", 9401, "10.0.0.5") == "https://10.0.0.5:9401/metrics"
    assert metrics_url("http", "::", 9401, "fd00::5") == "http://[fd00::5]:9401/metrics"
    assert metrics_url("http", "::", 9401, None) == "http://127.0.0.1:9401/metrics"
    assert split_metrics_url("http://[fd00::5]:9401/metrics") == (
        "http",
        "[fd00::5]:9401",
        "/metrics",
    )
