"""Traffic reports: stored per window, unknown ones skipped; read back merged over gateways with
Prometheus-style quantiles, a series per step, the engines' diffusion figures; pruned at 24 h."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from controlplane.services.traffic import histogram_quantile
from protocol.gateway import BUCKET_COUNT, LATENCY_BUCKETS_S, DeploymentTraffic
from tests.controlplane.conftest import Api, deploy, register_version
from tests.controlplane.fleet import ADDRESS, beat, report, serving_fleet, version_id_of

V = "/api/v1"


def buckets(**counts: int) -> list[int]:
    """Per-bucket counts, by upper bound name: b0_1 is the bucket up to 0.1 s, inf the last."""
    out = [0] * BUCKET_COUNT
    for key, count in counts.items():
        bound = float(key[1:].replace("_", ".")) if key != "inf" else None
        out[LATENCY_BUCKETS_S.index(bound) if bound else BUCKET_COUNT - 1] = count
    return out


def window(version_id: int, deployment: str = "web", **counts: Any) -> dict[str, Any]:
    return {"deployment": deployment, "version_id": version_id, "pool": "stable", **counts}


def post(
    api: Api, token: str, gateway: str, ended_at: datetime, *windows: dict[str, Any]
) -> httpx.Response:
    body = {
        "gateway": gateway,
        "started_at": (ended_at - timedelta(seconds=5)).isoformat(),
        "ended_at": ended_at.isoformat(),
        "windows": list(windows),
    }
    response: httpx.Response = api.call("POST", f"{V}/traffic", token, json=body)
    return response


def query(api: Api, **params: Any) -> httpx.Response:
    response: httpx.Response = api.as_admin("GET", f"{V}/deployments/web/traffic", params=params)
    return response


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 8 in (0.05, 0.1], 2 in (0.1, 0.25], 10 in (0.25, 0.5]: rank 10 ends the second bucket,
    # rank 19 lies 9/10 into the third.
    counts = buckets(b0_1=8, b0_25=2, b0_5=10)
    assert histogram_quantile(0.5, counts) == pytest.approx(0.25)
    assert histogram_quantile(0.95, counts) == pytest.approx(0.25 + 0.25 * 0.9)
    # The first bucket starts at 0; the +Inf bucket answers its lower bound, the last finite one.
    assert histogram_quantile(0.5, buckets(b0_005=4)) == pytest.approx(0.0025)
    assert histogram_quantile(0.5, buckets(inf=3)) == 300.0
    assert histogram_quantile(0.5, [0] * BUCKET_COUNT) is None


def test_two_gateways_windows_merge_into_one_series(api: Api) -> None:
    serving_fleet(api)
    v1 = version_id_of(api, "demo:v1")
    gw_a, gw_b = api.token("gateway"), api.token("gateway")
    start = api.clock()
    # gw-a: 8 requests in two windows, 1 answered 5xx and 1 timed out; gw-b: 12, 2 failed to
    # connect, 3 answered 4xx (the clients' doing: not errors of the version).
    first = post(
        api, gw_a, "gw-a", start - timedelta(seconds=55),
        window(v1, requests=6, errors_5xx=1, output_tokens=60, latency_buckets=buckets(b0_1=6),
               latency_sum_s=0.5, ttft_buckets=buckets(b0_05=6), ttft_sum_s=0.2),
    )  # fmt: skip
    assert first.status_code == 200, first.text
    assert first.json() == {"accepted": 1, "skipped": []}
    # The same report again (the gateway got no answer and retried): counted once.
    retried = post(
        api, gw_a, "gw-a", start - timedelta(seconds=55),
        window(v1, requests=6, errors_5xx=1, output_tokens=60, latency_buckets=buckets(b0_1=6),
               latency_sum_s=0.5, ttft_buckets=buckets(b0_05=6), ttft_sum_s=0.2),
    )  # fmt: skip
    assert retried.json() == {"accepted": 1, "skipped": []}
    assert post(
        api, gw_b, "gw-b", start - timedelta(seconds=52),
        window(v1, requests=12, errors_connect=2, client_4xx=3, output_tokens=100,
               latency_buckets=buckets(b0_1=2, b0_5=10), latency_sum_s=3.0,
               ttft_buckets=buckets(inf=12), ttft_sum_s=4000.0),
    ).is_success  # fmt: skip
    assert post(
        api, gw_a, "gw-a", start - timedelta(seconds=44),
        window(v1, requests=2, errors_timeout=1, output_tokens=5,
               latency_buckets=buckets(b0_25=2), latency_sum_s=0.4),
    ).is_success  # fmt: skip
    # Outside the range asked for below: ended before it, or after it.
    before = start - timedelta(seconds=61)
    assert post(api, gw_a, "gw-a", before, window(v1, requests=100)).is_success
    assert post(api, gw_b, "gw-b", start, window(v1, requests=100)).is_success

    response = query(
        api, since=(start - timedelta(seconds=60)).isoformat(),
        until=(start - timedelta(seconds=1)).isoformat(), step_s=10,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    traffic = DeploymentTraffic.model_validate(response.json())
    assert (traffic.deployment, traffic.step_s, traffic.gateways) == ("web", 10, 2)
    [stable] = traffic.versions
    assert (stable.version_id, stable.version, stable.pool) == (v1, "demo:v1", "stable")
    assert (stable.requests, stable.errors_5xx, stable.errors_timeout, stable.errors_connect,
            stable.client_4xx) == (20, 1, 1, 2, 3)  # fmt: skip
    assert stable.output_tokens == 165 and stable.errors == 4
    assert stable.error_rate == pytest.approx(0.2)
    assert stable.latency_buckets == buckets(b0_1=8, b0_25=2, b0_5=10)
    assert stable.latency_sum_s == pytest.approx(3.9)
    # Hand-computed from the merged buckets (see the quantile test above).
    assert stable.latency_p50_s == pytest.approx(0.25)
    assert stable.latency_p95_s == pytest.approx(0.475)
    assert stable.latency_p99_s == pytest.approx(0.25 + 0.25 * 0.98)
    # TTFT: 6 in (0.025, 0.05], 12 above 300 s: p50 (rank 9) is in +Inf -> 300.
    assert stable.ttft_buckets == buckets(b0_05=6, inf=12)
    assert stable.ttft_p50_s == 300.0 and stable.ttft_p95_s == 300.0
    assert stable.steps_per_block is None and stable.tokens_per_forward is None  # no engine

    # Steps are (k*10 s, (k+1)*10 s], labelled by their end: 11:59:05 and 11:59:08 -> 11:59:10;
    # 11:59:16 -> 11:59:20.
    [series] = traffic.series
    assert (series.version_id, series.version) == (v1, "demo:v1")
    points = [(p.time, p.requests, p.errors, p.output_tokens) for p in series.points]
    assert points == [
        (start - timedelta(seconds=50), 18, 3, 160),
        (start - timedelta(seconds=40), 2, 1, 5),
    ]
    # The first step has 8 in (0.05, 0.1] and 10 in (0.25, 0.5]: rank 17.1 is 9.1/10 into the
    # latter.
    assert series.points[0].latency_p95_s == pytest.approx(0.25 + 0.25 * 0.91)
    assert series.points[1].ttft_p95_s is None

    # Defaults: the five minutes up to now, steps of 10 s.
    recent = DeploymentTraffic.model_validate(query(api).json())
    assert recent.until == start and recent.since == start - timedelta(minutes=5)
    assert recent.step_s == 10 and recent.versions[0].requests == 220


def test_canary_and_stable_are_reported_apart(api: Api) -> None:
    serving_fleet(api, per_host=2)
    v1, v2 = version_id_of(api, "demo:v1"), version_id_of(api, "demo:v2")
    assert api.as_admin(
        "PUT", f"{V}/deployments/web/canary", json={"version": "v2", "weight": 10}
    ).is_success
    gateway = api.token("gateway")
    canary = {**window(v2, requests=4, errors_5xx=4), "pool": "canary"}
    assert post(api, gateway, "gw-a", api.clock(), window(v1, requests=36), canary).is_success
    traffic = DeploymentTraffic.model_validate(query(api).json())
    rates = {v.version_id: (v.version, v.pool, v.requests, v.error_rate) for v in traffic.versions}
    assert rates == {v1: ("demo:v1", "stable", 36, 0.0), v2: ("demo:v2", "canary", 4, 1.0)}


def test_windows_of_unknown_deployments_or_versions_are_skipped(api: Api) -> None:
    serving_fleet(api)
    register_version(api, name="other")
    v1, v2 = version_id_of(api, "demo:v1"), version_id_of(api, "demo:v2")
    other = version_id_of(api, "other:v1")
    unknown = max(v1, v2, other) + 1
    gateway = api.token("gateway")
    response = post(
        api,
        gateway,
        "gw-a",
        api.clock(),
        window(v1, requests=1),
        window(v1, deployment="gone", requests=2),
        window(unknown, requests=3),
        window(other, requests=4),  # registered, but not of web's model
        window(v2, requests=6),  # web's model's, though not routed: counted
    )
    assert response.status_code == 200, response.text
    assert response.json() == {
        "accepted": 2,
        "skipped": [f"gone version {v1}", f"web version {unknown}", f"web version {other}"],
    }
    traffic = DeploymentTraffic.model_validate(query(api).json())
    assert {v.version: v.requests for v in traffic.versions} == {"demo:v1": 1, "demo:v2": 6}


def test_a_report_without_version_ids_is_refused_naming_the_field(api: Api) -> None:
    # A gateway of an older release sent MODEL:VERSION; its windows cannot be matched by id.
    serving_fleet(api)
    old = {"deployment": "web", "version": "demo:v1", "pool": "stable", "requests": 1}
    response = post(api, api.token("gateway"), "gw-old", api.clock(), old)
    assert response.status_code == 422, response.text
    assert response.json()["message"].startswith("windows.0.version_id: Field required")
    assert DeploymentTraffic.model_validate(query(api).json()).versions == []


def test_bad_reports_and_queries_are_refused_with_what_to_fix(api: Api) -> None:
    serving_fleet(api)
    v1 = version_id_of(api, "demo:v1")
    gateway = api.token("gateway")
    now = api.clock()
    ahead = post(api, gateway, "gw-a", now + timedelta(minutes=10), window(v1))
    assert ahead.status_code == 422 and "sync the gateway host's clock" in ahead.json()["message"]
    short = post(api, gateway, "gw-a", now, window(v1, latency_buckets=[1, 2]))
    assert short.status_code == 422 and "must have 16 buckets" in short.json()["message"]
    backwards = api.call(
        "POST", f"{V}/traffic", gateway,
        json={"gateway": "g", "started_at": now.isoformat(),
              "ended_at": (now - timedelta(seconds=1)).isoformat()},
    )  # fmt: skip
    assert backwards.status_code == 422 and "before started_at" in backwards.json()["message"]

    def refused(**params: Any) -> str:
        response = query(api, **params)
        assert response.status_code == 422, response.text
        message: str = response.json()["message"]
        return message

    assert refused(step_s=0) == "step_s must be between 1 and 3600 seconds, not 0"
    assert refused(step_s=3601) == "step_s must be between 1 and 3600 seconds, not 3601"
    assert "must be before until" in refused(since=now.isoformat(), until=now.isoformat())
    far = (now - timedelta(hours=25)).isoformat()
    assert refused(since=far) == "the range from since to until may span at most 24 hours"
    assert "since" in refused(since="yesterday")
    missing = api.as_admin("GET", f"{V}/deployments/nope/traffic")
    assert missing.status_code == 404 and missing.json()["message"] == "deployment 'nope' not found"
    # A time without a zone is UTC.
    naive = query(api, until=now.replace(tzinfo=None).isoformat())
    assert naive.status_code == 200 and naive.json()["until"].startswith("2026-01-01T12:00:00")


def test_diffusion_figures_come_from_the_engines_heartbeats(api: Api) -> None:
    agent = serving_fleet(api, per_host=2)
    assert api.as_admin(
        "PUT", f"{V}/deployments/web/canary", json={"version": "v2", "weight": 10}
    ).is_success
    desired = report(api, agent)
    by_version = {i["model"]["version"]: i["instance_id"] for i in desired}

    def metrics(instance_id: int, steps: tuple[float, float], tpf: tuple[float, float]) -> Any:
        # Histogram deltas as the agent sends them: keyed by the family name, no suffix.
        return {
            "instance_id": instance_id,
            "histograms": {
                "dllm_denoising_steps_per_block": {"sum": steps[0], "count": steps[1]},
                "dllm_tokens_per_forward": {"sum": tpf[0], "count": tpf[1]},
                "dllm_batch_size": {"sum": 0, "count": 0},
            },
        }

    api.clock.advance(10)
    beat(api, agent, advertise_address=ADDRESS, metrics=[
        metrics(by_version["v1"], (30, 10), (40, 20)), metrics(by_version["v2"], (8, 4), (9, 3)),
    ])  # fmt: skip
    api.clock.advance(5)
    beat(api, agent, advertise_address=ADDRESS, metrics=[
        metrics(by_version["v1"], (10, 10), (20, 10)),
    ])  # fmt: skip
    api.clock.advance(10)  # a new 10 s bucket: the last one is written
    beat(api, agent, advertise_address=ADDRESS)
    with api.engine.connect() as conn:
        names = set(conn.execute(sa.text("SELECT DISTINCT name FROM metricsample")).scalars())
    assert {"dllm_denoising_steps_per_block_sum", "dllm_tokens_per_forward_count"} <= names
    assert not any(n.startswith("dllm_batch_size") for n in names)  # nothing observed: no rows

    traffic = DeploymentTraffic.model_validate(query(api).json())
    figures = {v.version: (v.steps_per_block, v.tokens_per_forward) for v in traffic.versions}
    assert figures["demo:v1"] == (pytest.approx(40 / 20), pytest.approx(60 / 30))
    assert figures["demo:v2"] == (pytest.approx(2.0), pytest.approx(3.0))
    assert all(v.requests == 0 and v.error_rate is None for v in traffic.versions)


def test_old_windows_are_pruned_with_the_samples(api: Api) -> None:
    serving_fleet(api)
    v1 = version_id_of(api, "demo:v1")
    gateway = api.token("gateway")
    now = api.clock()
    assert post(api, gateway, "gw-a", now - timedelta(hours=23), window(v1, requests=1)).is_success
    assert post(api, gateway, "gw-a", now, window(v1, requests=2)).is_success

    def requests() -> list[int]:
        with api.engine.connect() as conn:
            query = "SELECT requests FROM trafficwindow ORDER BY id"
            return list(conn.execute(sa.text(query)).scalars())

    assert requests() == [1, 2]
    assert api.app.state.ctx.health.prune_samples(now + timedelta(hours=2)) >= 1
    assert requests() == [2]


def test_windows_go_with_their_deployment(api: Api) -> None:
    serving_fleet(api)
    v1 = version_id_of(api, "demo:v1")
    gateway = api.token("gateway")
    assert post(api, gateway, "gw-a", api.clock(), window(v1, requests=1)).is_success
    assert api.as_admin("DELETE", f"{V}/deployments/web").status_code == 204
    assert deploy(api, "web", ["gpu-1"]).status_code == 201
    assert DeploymentTraffic.model_validate(query(api).json()).versions == []


def test_a_big_report_passes_the_ordinary_body_limit_for_gateways_only(api: Api) -> None:
    serving_fleet(api)
    gateway = api.token("gateway")
    # A busy window as a gateway sends it: every field, six-digit counts.
    counts = {"errors_5xx": 123456, "errors_timeout": 123456, "errors_connect": 123456,
              "client_4xx": 123456, "output_tokens": 123456789, "latency_sum_s": 12345.678901,
              "ttft_sum_s": 1234.5678901}  # fmt: skip
    full = window(
        version_id_of(api, "demo:v1"),
        requests=1,
        latency_buckets=[123456] * BUCKET_COUNT,
        ttft_buckets=[123456] * BUCKET_COUNT,
        **counts,
    )
    body = {
        "gateway": "gw-a",
        "started_at": (api.clock() - timedelta(seconds=5)).isoformat(),
        "ended_at": api.clock().isoformat(),
        "windows": [full] * 4096,
    }
    assert len(json.dumps(body)) > 1 << 20  # more than any other route takes
    accepted = api.call("POST", f"{V}/traffic", gateway, json=body)
    assert accepted.status_code == 200 and accepted.json()["accepted"] == 4096
    assert DeploymentTraffic.model_validate(query(api).json()).versions[0].requests == 4096
    anonymous = api.call("POST", f"{V}/traffic", None, json=body)
    assert anonymous.status_code == 401
    viewer = api.call("POST", f"{V}/traffic", api.token("viewer"), json=body)
    assert viewer.status_code == 403
