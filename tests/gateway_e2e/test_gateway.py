"""The gateway with real processes: control plane, agent, two engines (stable demo:v1 and canary
demo:v2 at weight 20) and `dctl gateway` in front, all on loopback.

The tests share one fleet and run in file order; each leaves it with both pools ready.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from protocol.gateway import DeploymentTraffic
from protocol.rest import InstanceOut
from tests.agent_e2e.conftest import wait_for
from tests.gateway_e2e.conftest import CANARY_WEIGHT, Fleet

BODY = {"model": "demo", "prompt": "Hello", "max_tokens": 1}


def auth(fleet: Fleet) -> dict[str, str]:
    return {"Authorization": f"Bearer {fleet.client_token}"}


def pinned(fleet: Fleet, pool: str) -> dict[str, str]:
    """Headers pinning POOL, with the token granted it."""
    return {"Authorization": f"Bearer {fleet.pinning_token}", "x-dctl-pool": pool}


def instances(fleet: Fleet) -> dict[str, InstanceOut]:
    """The ready instance of each version, by version tag."""
    found = {}
    for inst in fleet.api.get_deployment("demo").instances:
        if inst.observed_state == "ready":
            found[inst.version] = inst
    return found


def gauge(url: str, name: str, missing: float | None = None, **labels: str) -> float:
    """The sum of NAME's samples at URL whose labels include LABELS; MISSING when there is none
    (a labelled counter nothing has counted yet has no sample), else that is an error."""
    text = httpx.get(url, timeout=10).text
    found = [
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]
    if not found:
        if missing is not None:
            return missing
        raise AssertionError(f"{name} {labels} not in {url}")
    return sum(found)


def test_the_openai_client_works_unchanged_streaming_and_not(fleet: Fleet) -> None:
    gateway = fleet.gateways[0]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=fleet.client_token)
    models = [m.id for m in client.models.list()]
    assert models == ["demo"]
    raw = client.chat.completions.with_raw_response.create(
        model="demo",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=4,
        extra_headers={"x-request-id": "e2e-req-1"},
    )
    chat = raw.parse()
    assert chat.choices[0].message.content is not None
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    assert raw.headers["x-dctl-version"] in {"demo:v1", "demo:v2"}
    assert raw.headers["x-request-id"] == "e2e-req-1"
    instance_id = int(raw.headers["x-dctl-instance"])
    assert instance_id in {i.id for i in instances(fleet).values()}
    # The id ties the gateway's log line to the engine's.
    engine_log = fleet.stack.agent_data() / "agent" / "run" / "logs" / f"instance-{instance_id}.log"
    wait_for("the engine to log the request id", lambda: "e2e-req-1" in engine_log.read_text(), 10)
    assert "e2e-req-1" in gateway.log.read_text()
    stream = client.completions.create(model="demo", prompt="Once", max_tokens=8, stream=True)
    chunks = list(stream)
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in {"length", "stop"}


def test_weight_20_sends_a_fifth_of_1000_requests_to_the_canary_and_the_header_pins(
    fleet: Fleet,
) -> None:
    url = f"{fleet.gateways[0].url}/v1/completions"
    with httpx.Client(timeout=60, headers=auth(fleet)) as http:

        def one(_: int) -> str:
            response = http.post(url, json=BODY)
            assert response.status_code == 200, response.text
            return response.headers["x-dctl-version"]

        with ThreadPoolExecutor(16) as pool:
            versions = Counter(pool.map(one, range(1000)))
        share = versions["demo:v2"] / 1000 * 100
        assert abs(share - CANARY_WEIGHT) <= 4, versions
        for pool_name, version in (("canary", "demo:v2"), ("stable", "demo:v1")):
            versions = {
                http.post(url, json=BODY, headers=pinned(fleet, pool_name)).headers[
                    "x-dctl-version"
                ]
                for _ in range(10)
            }
            assert versions == {version}
        bad = http.post(url, json=BODY, headers=pinned(fleet, "blue"))
        assert bad.status_code == 400 and "x-dctl-pool" in bad.json()["error"]["message"]
        # An ordinary client token may not pin (it would choose what the analysis compares).
        refused = http.post(url, json=BODY, headers={"x-dctl-pool": "canary"})
        assert refused.status_code == 403 and "--allow-pool-pin" in refused.text


def test_bad_requests_get_openai_errors(fleet: Fleet) -> None:
    url = f"{fleet.gateways[0].url}/v1/completions"
    missing = httpx.post(url, json=BODY)
    assert missing.status_code == 401 and missing.json()["error"]["type"]
    unknown = httpx.post(url, json={**BODY, "model": "nope"}, headers=auth(fleet))
    assert unknown.status_code == 404
    assert "demo" in unknown.json()["error"]["message"]
    huge = httpx.post(
        url, content=b'{"model": "demo", "prompt": "' + b"a" * (9 << 20) + b'"}',
        headers={**auth(fleet), "content-type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert huge.status_code == 413


def test_a_revoked_client_token_is_refused_within_5_seconds(fleet: Fleet) -> None:
    from protocol.rest import TokenCreate

    secret = fleet.api.create_token(TokenCreate(name="shortlived", role="client")).secret
    url = f"{fleet.gateways[0].url}/v1/completions"
    headers = {"Authorization": f"Bearer {secret}"}
    wait_for("the new token to work", lambda: httpx.post(url, json=BODY, headers=headers)
             .status_code == 200, 10)  # fmt: skip
    fleet.api.revoke_token("shortlived")
    revoked_at = time.monotonic()
    wait_for("the revoked token to be refused", lambda: httpx.post(url, json=BODY, headers=headers)
             .status_code == 401, 10)  # fmt: skip
    assert time.monotonic() - revoked_at <= 5.0


def test_a_client_disconnect_cancels_the_request_on_the_engine(fleet: Fleet) -> None:
    stable = instances(fleet)["v1"]
    metrics = f"http://127.0.0.1:{stable.port}/metrics"
    aborted = "dllm_requests_finished_total"
    before = gauge(metrics, aborted, finish_reason="abort")
    body = {"model": "demo", "prompt": "Hello there", "max_tokens": 400, "steps": 4,
            "stream": True}  # fmt: skip
    with httpx.Client(timeout=60) as http, http.stream(
        "POST", f"{fleet.gateways[0].url}/v1/completions", json=body,
        headers=pinned(fleet, "stable"),
    ) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a dropped iterator closes the response
        next(line for line in lines if line.startswith("data: "))
        assert response.headers["x-dctl-instance"] == str(stable.id)
        # The gauge is sampled at the engine's step boundaries: give it a step or two.
        wait_for("the engine to count it", lambda: gauge(metrics, "dllm_requests_running") == 1, 5)
    # The client went away: the gateway closes its upstream connection and the engine aborts
    # long before 400 tokens are done.
    wait_for("the engine to cancel", lambda: gauge(metrics, "dllm_requests_running") == 0, 20)
    assert gauge(metrics, aborted, finish_reason="abort") == before + 1


def test_an_engine_killed_with_9_costs_no_request(fleet: Fleet) -> None:
    canary = instances(fleet)["v2"]
    pid_file = fleet.stack.agent_data() / "agent" / "run" / f"instance-{canary.id}.json"
    pid = json.loads(pid_file.read_text())["pid"]
    url = f"{fleet.gateways[0].url}/v1/completions"
    with httpx.Client(timeout=60, headers=auth(fleet)) as http:

        def one(i: int) -> int:
            if i == 40:
                os.kill(pid, signal.SIGKILL)
            return http.post(url, json={**BODY, "max_tokens": 4}).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = Counter(pool.map(one, range(300)))
    assert codes == {200: 300}
    # A retry or two may be all it takes before the agent reports the engine gone: no ejection.
    ejections = gauge(f"{fleet.gateways[0].url}/metrics", "dctl_gateway_ejections_total", 0.0)
    retries = gauge(f"{fleet.gateways[0].url}/metrics", "dctl_gateway_retries_total", 0.0)
    assert ejections + retries >= 1  # the dead instance was noticed, not just lucky timing
    fleet.both_pools_ready()  # the agent restarts it


def test_two_gateways_reports_merge_into_one_traffic_series(fleet: Fleet) -> None:
    second = fleet.start_gateway("gateway-2")
    time.sleep(2.5)  # earlier tests' windows reach the control plane first
    since = datetime.now(UTC)
    # Not pinned: a pinned request is in no traffic window (tests/security/...pool_pinning).
    for gateway, count in ((fleet.gateways[0], 30), (second, 20)):
        for _ in range(count):
            response = httpx.post(
                f"{gateway.url}/v1/completions", json=BODY, timeout=60, headers=auth(fleet)
            )
            assert response.status_code == 200

    def merged() -> DeploymentTraffic | None:
        traffic = fleet.api.deployment_traffic("demo", since=since)
        return traffic if sum(v.requests for v in traffic.versions) >= 50 else None

    traffic = wait_for("both gateways' windows", merged, 20)
    assert traffic.gateways == 2
    assert sum(v.requests for v in traffic.versions) == 50
    assert sum(v.errors for v in traffic.versions) == 0
    assert sum(v.output_tokens for v in traffic.versions) == 50
    [stable] = [v for v in traffic.versions if v.version == "demo:v1"]
    assert stable.error_rate == 0
    assert stable.latency_p50_s is not None and stable.latency_p95_s is not None
    assert sum(p.requests for s in traffic.series for p in s.points) == 50
    shown = fleet.stack.dctl("deploy", "traffic", "demo", "--since", "1h").stdout
    assert "from 2 gateway(s)" in shown and "demo:v1" in shown and "stable" in shown


def recorded_requests(fleet: Fleet) -> int:
    """Requests the control plane has on record for demo, over the last hour."""
    since = datetime.now(UTC) - timedelta(hours=1)
    traffic = fleet.api.deployment_traffic("demo", since=since)
    return sum(v.requests for v in traffic.versions)


def test_the_gateway_keeps_routing_while_the_control_plane_is_down(fleet: Fleet) -> None:
    url = f"{fleet.gateways[0].url}/v1/completions"
    time.sleep(2.5)  # every window so far has been reported
    before = recorded_requests(fleet)
    fleet.stack.stop_server()
    try:
        time.sleep(2)  # several route polls and a report fail meanwhile
        for _ in range(10):
            response = httpx.post(url, json=BODY, timeout=60, headers=auth(fleet))
            assert response.status_code == 200, response.text
        assert httpx.get(f"{fleet.gateways[0].url}/health/ready").status_code == 200
    finally:
        fleet.stack.start_server()
    # What was served during the outage reaches the control plane once it is back: nothing lost.
    wait_for("the outage's windows", lambda: recorded_requests(fleet) == before + 10, 20)
