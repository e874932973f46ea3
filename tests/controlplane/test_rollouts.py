"""Rollouts driven round by round with an injected clock: the agents' reports and the gateways'
traffic are real API calls, the controller is the app's own (ticked by the test)."""

from __future__ import annotations

import http.server
import json
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, ClassVar

import httpx
import pytest

from controlplane.rollouts.controller import RolloutController
from controlplane.rollouts.notify import Notifier
from protocol.gateway import BUCKET_COUNT, LATENCY_BUCKETS_S
from protocol.rollout_states import RolloutPhase, RolloutState
from protocol.rollouts import RolloutOut
from tests.controlplane.conftest import Api, deploy, register_version
from tests.controlplane.fleet import (
    ADDRESS,
    V1_DIGEST,
    V2_DIGEST,
    V2_MANIFEST,
    beat,
    gpu_host,
    report,
    serving_fleet,
    version_id_of,
)

V = "/api/v1"
INTERVAL = 60


def controller(api: Api) -> RolloutController:
    found = [c for c in api.app.state.controllers.controllers if c.name == "rollouts"]
    assert len(found) == 1
    rollouts: RolloutController = found[0]
    return rollouts


def tick(api: Api, times: int = 1, held: tuple[str, ...] | None = None) -> None:
    """Rounds of the controller, after a heartbeat saying which snapshots gpu-1 holds (by
    default v1's and v2's, so pre-staging passes at once)."""
    held = (V1_DIGEST, V2_DIGEST) if held is None else held
    beat(api, api.agent_tokens["gpu-1"], advertise_address=ADDRESS,
         facts={"snapshots": sorted(held)})  # fmt: skip
    for _ in range(times):
        controller(api).tick(api.clock())


def status(api: Api, name: str = "web") -> RolloutOut:
    response = api.as_admin("GET", f"{V}/deployments/{name}/rollout")
    assert response.status_code == 200, response.text
    return RolloutOut.model_validate(response.json())


def versions(api: Api) -> Counter[str]:
    body = api.as_admin("GET", f"{V}/deployments/web").json()
    return Counter(i["version"] for i in body["instances"])


def start(api: Api, **body: Any) -> httpx.Response:
    body = {"to": "v2", "policy": {"interval_s": INTERVAL, "min_requests": 10}, **body}
    response: httpx.Response = api.as_admin("POST", f"{V}/deployments/web/rollout", json=body)
    return response


def latency(seconds: float, n: int) -> list[int]:
    out = [0] * BUCKET_COUNT
    out[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if b >= seconds)] = n
    return out


def traffic(
    api: Api, gateway: str, *, stable: tuple[int, int], canary: tuple[int, int],
    canary_latency: float = 0.3,
) -> None:  # fmt: skip
    """One gateway report ending now: (requests, errors) per pool, stable at 0.3 s."""
    now = api.clock()
    windows = []
    for version, pool, (n, errors), seconds in (
        ("demo:v1", "stable", stable, 0.3), ("demo:v2", "canary", canary, canary_latency),
    ):  # fmt: skip
        if n:
            windows.append({
                "deployment": "web", "version_id": version_id_of(api, version), "pool": pool,
                "requests": n, "errors_5xx": errors, "latency_buckets": latency(seconds, n),
                "latency_sum_s": seconds * n, "ttft_buckets": latency(seconds / 3, n),
                "ttft_sum_s": seconds / 3 * n,
            })  # fmt: skip
    body = {"gateway": "gw-1", "started_at": (now - timedelta(seconds=5)).isoformat(),
            "ended_at": now.isoformat(), "windows": windows}  # fmt: skip
    response = api.call("POST", f"{V}/traffic", gateway, json=body)
    assert response.status_code == 200, response.text


def serve_interval(api: Api, agent: str, gateway: str, **kwargs: Any) -> None:
    """An interval of traffic in 6 reports, the agent reporting each time, then one round."""
    for _ in range(6):
        api.clock.advance(INTERVAL / 6)
        report(api, agent)
        traffic(api, gateway, **kwargs)
        tick(api)


def ready_round(api: Api, agent: str) -> None:
    """The agent reports every instance ready on its desired version; one round."""
    report(api, agent)
    tick(api)


@pytest.fixture
def fleet(api: Api) -> tuple[str, str]:
    """Deployment web of demo:v1 with 4 instances on gpu-1, all ready; a gateway token."""
    agent = serving_fleet(api, per_host=4)
    report(api, agent)
    # Rounds here are as far apart as the test's clock steps, not a second.
    controller(api).leaderless_gap = timedelta(seconds=INTERVAL)
    return agent, api.token("gateway")


def test_a_good_canary_goes_step_by_step_to_promotion_and_rolls_back(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, gateway = fleet
    started = start(api, steps=[25, 50, 100], reason="v2 is better")
    assert started.status_code == 201, started.text
    body = started.json()
    assert (body["from"], body["to"], body["steps"], body["state"]) == (
        "demo:v1",
        "demo:v2",
        [25, 50, 100],
        RolloutState.PROGRESSING,
    )
    tick(api)
    out = status(api)
    # One canary instance (25% of 4), no traffic before it is ready.
    assert (out.canary_instances, out.weight, out.phase) == (1, 0, "waiting")
    assert versions(api) == {"v1": 3, "v2": 1}
    ready_round(api, agent)
    out = status(api)
    assert (out.step, out.weight, out.phase, out.canary_ready) == (1, 25, RolloutPhase.ANALYSING, 1)
    assert out.time_left_s == pytest.approx(INTERVAL)

    serve_interval(api, agent, gateway, stable=(30, 0), canary=(10, 0))
    out = status(api)
    assert out.analysis is not None and out.analysis.verdict == "pass"
    assert {m.metric: m.verdict for m in out.analysis.metrics}["error rate"] == "pass"
    assert (out.step, out.canary_instances) == (2, 2)
    ready_round(api, agent)
    assert status(api).weight == 50
    serve_interval(api, agent, gateway, stable=(20, 0), canary=(20, 0))
    # Promotion: every request to the new version, the rest moved one instance at a time.
    out = status(api)
    assert (out.phase, out.weight) == (RolloutPhase.PROMOTING, 100)
    seen = []
    for _ in range(6):
        seen.append(versions(api)["v2"])
        ready_round(api, agent)
    assert seen[:2] == [3, 4]
    out = status(api)
    assert (out.state, out.weight, out.canary_instances) == (RolloutState.PROMOTED, 0, 0)
    assert [a.verdict for a in out.analyses] == ["pass", "pass"]
    shown = api.as_admin("GET", f"{V}/deployments/web").json()
    assert (shown["version"], shown["canary_version"]) == ("v2", None)
    assert shown["rollback_version"] == "v1"  # what `dctl rollback` (and the TUI) offers first
    assert versions(api) == {"v2": 4}
    # The host keeps v1's snapshot: it is the rollback target.
    kept = beat(api, agent, advertise_address=ADDRESS)["keep_digests"]
    assert set(kept) == {V1_DIGEST, V2_DIGEST}

    # Rollback: to v1 (kept as the rollback target), no analysis, one instance at a time.
    back = api.as_admin("POST", f"{V}/deployments/web/rollback", json={"reason": "oops"})
    assert back.status_code == 201, back.text
    assert (back.json()["kind"], back.json()["to"]) == ("rollback", "demo:v1")
    moved = []
    for _ in range(8):
        ready_round(api, agent)
        moved.append(versions(api)["v1"])
    assert moved[0] == 1 and moved[1] == 2  # rolling
    out = status(api)
    assert (out.kind, out.state) == ("rollback", RolloutState.ROLLED_BACK)
    assert api.as_admin("GET", f"{V}/deployments/web").json()["version"] == "v1"
    kinds = [e["kind"] for e in api.as_admin("GET", f"{V}/events").json()["items"]]
    for kind in ("rollout.started", "rollout.step", "rollout.promoted", "rollback.rolled_back"):
        assert kind in kinds
    history = api.as_admin("GET", f"{V}/deployments/web/rollouts").json()
    assert [(h["kind"], h["state"]) for h in history] == [
        ("rollback", RolloutState.ROLLED_BACK),
        ("rollout", RolloutState.PROMOTED),
    ]


def test_errors_on_the_canary_abort_it_after_the_failure_limit(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, gateway = fleet
    assert start(api, canary=25).status_code == 201
    tick(api)
    ready_round(api, agent)
    serve_interval(api, agent, gateway, stable=(40, 0), canary=(20, 10))
    out = status(api)
    assert (out.state, out.step) == (RolloutState.PROGRESSING, 1)  # one failure of two
    assert out.analysis is not None and out.analysis.verdict == "fail"
    serve_interval(api, agent, gateway, stable=(40, 0), canary=(20, 10))
    out = status(api)
    assert (out.state, out.weight, out.canary_instances) == (RolloutState.ABORTED, 0, 0)
    assert "error rate" in out.reason and "0.5" in out.reason
    assert versions(api) == {"v1": 4}  # back on the snapshot the host kept
    # The analysis is kept with the figures.
    rates = {m.metric: (m.stable, m.canary) for m in out.analyses[-1].metrics}
    assert rates["error rate"] == (0.0, 0.5)


def diffusion(instance_id: int, steps_per_block: float) -> dict[str, Any]:
    """An engine's diffusion histograms over 10 blocks of 16 tokens, as a heartbeat has them."""
    return {"instance_id": instance_id, "histograms": {
        "dllm_denoising_steps_per_block": {"sum": steps_per_block * 10, "count": 10},
        "dllm_tokens_per_forward": {"sum": 10 * 16 / steps_per_block, "count": 10},
    }}  # fmt: skip


def serve_decoding_interval(
    api: Api, agent: str, gateway: str, stable: float, canary: float
) -> None:
    """A rollout's first step started, then an interval of traffic whose stable engines report
    STABLE steps per block and whose canary reports CANARY."""
    assert start(api, canary=25, policy={"interval_s": INTERVAL, "min_requests": 10,
                                         "failure_limit": 1}).status_code == 201  # fmt: skip
    tick(api)
    desired = report(api, agent)
    tick(api)
    by_version = {i["model"]["version"]: i["instance_id"] for i in desired}
    for _ in range(6):
        api.clock.advance(INTERVAL / 6)
        beat(api, agent, advertise_address=ADDRESS, metrics=[
            diffusion(by_version["v1"], stable), diffusion(by_version["v2"], canary)
        ])  # fmt: skip
        traffic(api, gateway, stable=(30, 0), canary=(10, 0))
        tick(api)


def test_slower_decoding_aborts_even_without_errors(api: Api, fleet: tuple[str, str]) -> None:
    agent, gateway = fleet
    serve_decoding_interval(api, agent, gateway, stable=4.0, canary=8.0)
    out = status(api)
    assert out.state == RolloutState.ABORTED, out
    assert "steps per block" in out.reason and "tokens per forward" in out.reason
    verdicts = {m.metric: m.verdict for m in out.analyses[-1].metrics}
    assert verdicts["error rate"] == "pass" and verdicts["steps per block"] == "fail"


def test_decoding_figures_of_another_model_family_are_not_held_against_it(api: Api) -> None:
    # demo:v1 sized as SDAR at registration, demo:v2 as DiffusionGemma: a canvas takes more
    # steps than an SDAR block, and that says nothing about the canary.
    plan = {"weights_bytes": 2**30, "kv_bytes_per_token": 1024}
    register_version(api, memory_plan={**plan, "family": "sdar"})
    register_version(
        api, version="v2", manifest=V2_MANIFEST, memory_plan={**plan, "family": "diffusion-gemma"}
    )
    agent = gpu_host(api, advertise_address=ADDRESS)
    assert deploy(api, "web", ["gpu-1"], per_host=4).status_code == 201
    report(api, agent)
    controller(api).leaderless_gap = timedelta(seconds=INTERVAL)
    serve_decoding_interval(api, agent, api.token("gateway"), stable=2.0, canary=8.0)
    out = status(api)
    assert out.state == RolloutState.PROGRESSING and out.step == 2, out.reason
    [analysis] = out.analyses
    by_metric = {m.metric: m for m in analysis.metrics}
    assert analysis.verdict == "pass"
    steps = by_metric["steps per block"]
    assert (steps.stable, steps.canary, steps.verdict) == (2.0, 8.0, "inconclusive")
    assert steps.note.startswith("not comparable: sdar vs diffusion-gemma")
    assert by_metric["tokens per forward"].verdict == "inconclusive"


def test_no_traffic_extends_the_step_instead_of_promoting(api: Api, fleet: tuple[str, str]) -> None:
    agent, _gateway = fleet
    assert start(api, steps=[50, 100]).status_code == 201
    tick(api)
    ready_round(api, agent)
    for _ in range(6):
        api.clock.advance(INTERVAL / 2)
        tick(api)
    out = status(api)
    assert (out.state, out.step, out.weight) == (RolloutState.PROGRESSING, 1, 50)
    assert [a.verdict for a in out.analyses] == ["inconclusive"] * 3
    assert "extended" in out.reason
    assert versions(api) == {"v1": 2, "v2": 2}


def test_by_hand_pause_resume_promote_abort_and_one_at_a_time(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    assert start(api).status_code == 201
    second = start(api)
    assert second.status_code == 409 and "already has an active rollout" in second.json()["message"]
    tick(api)
    ready_round(api, agent)
    api.clock.advance(20)
    paused = api.as_admin("POST", f"{V}/deployments/web/rollout/pause", json={})
    assert paused.status_code == 200 and paused.json()["time_left_s"] == pytest.approx(40)
    api.clock.advance(600)  # time does not run while paused
    tick(api)
    assert status(api).time_left_s == pytest.approx(40)
    resumed = api.as_admin("POST", f"{V}/deployments/web/rollout/resume", json={})
    assert resumed.status_code == 200 and resumed.json()["time_left_s"] == pytest.approx(40)
    # promote: the next step now, without waiting for the interval.
    assert api.as_admin("POST", f"{V}/deployments/web/rollout/promote", json={}).is_success
    tick(api)
    out = status(api)
    assert (out.step, out.phase) == (2, "waiting")
    abort = api.as_admin(
        "POST", f"{V}/deployments/web/rollout/abort", json={"reason": "game day over"}
    )
    assert abort.status_code == 200
    # The canary is gone at once (no round needed): the routing table has weight 0.
    assert (abort.json()["state"], abort.json()["weight"]) == (RolloutState.ABORTED, 0)
    assert versions(api) == {"v1": 4}
    assert "game day over" in abort.json()["reason"]
    assert api.as_admin("POST", f"{V}/deployments/web/rollout/abort", json={}).status_code == 404
    # promote --full jumps to promotion.
    assert start(api).status_code == 201
    tick(api)
    full = api.as_admin("POST", f"{V}/deployments/web/rollout/promote", json={"full": True})
    assert full.status_code == 200
    for _ in range(8):
        ready_round(api, agent)
    assert status(api).state == RolloutState.PROMOTED
    assert versions(api) == {"v2": 4}


def test_bad_rollouts_are_refused_with_what_to_do(api: Api, fleet: tuple[str, str]) -> None:
    def refused(status_code: int, **body: Any) -> str:
        response = start(api, **body)
        assert response.status_code == status_code, response.text
        message: str = response.json()["message"]
        return message

    assert "new --engine-config" in refused(422, to="v1")  # the stable version, same config
    assert "not registered" in refused(422, to="v9")
    assert "model 'demo'" in refused(422, to="other:v2")
    assert "last step must be 100" in refused(422, steps=[10, 50])
    assert "must rise" in refused(422, steps=[50, 10, 100])
    assert "needs a new version" in refused(422, to=None)
    scale = api.as_admin("PATCH", f"{V}/deployments/web", json={"instances_per_host": 1})
    assert scale.status_code == 200
    message = refused(422)
    assert "--surge 1" in message and "dctl deploy scale web 2" in message
    missing = api.as_admin("POST", f"{V}/deployments/nosuch/rollout", json={"to": "v2"})
    assert missing.status_code == 404
    none = api.as_admin("GET", f"{V}/deployments/web/rollout")
    assert none.status_code == 404 and "never had one" in none.json()["message"]
    back = api.as_admin("POST", f"{V}/deployments/web/rollback", json={})
    assert back.status_code == 409 and "--to" in back.json()["message"]


def test_time_without_a_leader_does_not_count_against_the_step(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    assert start(api).status_code == 201
    tick(api)
    ready_round(api, agent)
    api.clock.advance(10)
    tick(api)
    assert status(api).time_left_s == pytest.approx(50)
    api.clock.advance(300)  # the control plane was down: no rounds
    tick(api)
    out = status(api)
    assert (out.step, out.phase) == (1, RolloutPhase.ANALYSING)
    assert out.time_left_s == pytest.approx(50)


def test_a_restart_replaces_one_instance_at_a_time(api: Api, fleet: tuple[str, str]) -> None:
    agent, _gateway = fleet
    made = api.as_admin("POST", f"{V}/deployments/web/restart", json={})
    assert made.status_code == 201 and made.json()["kind"] == "restart"
    assert start(api).status_code == 409  # one thing at a time
    stopped_together = []
    for _ in range(4):
        tick(api)
        desired = beat(api, agent, advertise_address=ADDRESS)["instances"]
        down = [i["instance_id"] for i in desired if i["desired_state"] == "stopped"]
        stopped_together.append(len(down))
        report_states(api, agent, {i: "stopped" for i in down})
        tick(api)
        report(api, agent)  # everything desired running comes back ready
        tick(api)
    assert stopped_together == [1, 1, 1, 1]
    tick(api)
    out = status(api)
    assert (out.kind, out.state) == ("restart", RolloutState.COMPLETED)
    assert "4 instance(s) restarted" in out.reason


def report_states(api: Api, agent: str, states: dict[int, str]) -> None:
    """The agent reports the given instances in the given states, the others ready."""
    desired = beat(api, agent, advertise_address=ADDRESS)["instances"]
    observed = [
        {"instance_id": i["instance_id"], "state": states.get(i["instance_id"], "ready"),
         "port": i["port"], "version_digest": i["model"]["digest"]}
        for i in desired
    ]  # fmt: skip
    beat(api, agent, instances=observed, advertise_address=ADDRESS)


class Receiver(http.server.BaseHTTPRequestHandler):
    """Collects notification bodies (class-level list, one server per test)."""

    bodies: ClassVar[list[dict[str, Any]]] = []
    status_code = 200

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        self.send_response(type(self).status_code)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def private_webhooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`notify_allow_private = true` before the `api` fixture reads its settings: the receiver
    listens on loopback (tests/security/test_controlplane_rollout_webhook.py: without it)."""
    monkeypatch.setenv("DCTL_NOTIFY_ALLOW_PRIVATE", "true")


@pytest.fixture
def receiver() -> Iterator[str]:
    Receiver.bodies = []
    Receiver.status_code = 200
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook?token=s3cret"
    server.shutdown()


def test_notifications_on_state_changes_and_failed_analyses(
    private_webhooks: None, api: Api, fleet: tuple[str, str], receiver: str
) -> None:
    assert api.settings.notify_allow_private
    agent, gateway = fleet
    policy = {"interval_s": INTERVAL, "min_requests": 10, "notify": receiver}
    assert start(api, canary=25, policy=policy).status_code == 201
    tick(api)
    ready_round(api, agent)
    serve_interval(api, agent, gateway, stable=(40, 0), canary=(20, 10))
    serve_interval(api, agent, gateway, stable=(40, 0), canary=(20, 10))
    tick(api)
    controller(api).notifier.close()
    events = [(b["event"], b["state"]) for b in Receiver.bodies]
    assert events == [
        ("state", RolloutState.PROGRESSING), ("analysis_failed", RolloutState.PROGRESSING),
        ("analysis_failed", RolloutState.ABORTED), ("state", RolloutState.ABORTED),
    ]  # fmt: skip
    assert all(b["deployment"] == "web" and b["to"] == "demo:v2" for b in Receiver.bodies)
    assert "error rate" in Receiver.bodies[-1]["reason"]


def test_a_notification_that_cannot_be_delivered_is_in_the_event_log(
    private_webhooks: None, api: Api, fleet: tuple[str, str], receiver: str
) -> None:
    Receiver.status_code = 500
    rollouts = controller(api)
    rollouts.notifier = Notifier(
        rollouts._notice_failed, allow_private=True, backoff_s=(0.01, 0.01)
    )
    policy = {"interval_s": INTERVAL, "notify": receiver}
    assert start(api, policy=policy).status_code == 201
    tick(api)
    rollouts.notifier.close()
    assert len(Receiver.bodies) == 3  # three attempts
    failed = api.as_admin("GET", f"{V}/events", params={"kind": "rollout.notify_failed"}).json()
    (event,) = failed["items"]
    assert "HTTP 5xx" in event["message"] and "3 attempts" in event["message"]
    assert "s3cret" not in event["message"] and "/hook" not in event["message"]


def test_an_engine_config_alone_rolls_out_as_the_same_weights_under_a_new_tag(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    config = {"model": {"steps": 2}, "chaos": {"error_rate": 0.0}}
    made = start(api, to=None, engine_config=config, steps=[50, 100])
    assert made.status_code == 201, made.text
    to = made.json()["to"]
    assert to.startswith("demo:v1-config-") and made.json()["engine_config_changed"]
    tick(api)
    desired = beat(api, agent, advertise_address=ADDRESS)["instances"]
    canary = [i for i in desired if i["model"]["version"] == to.split(":")[1]]
    stable = [i for i in desired if i["model"]["version"] == "v1"]
    assert len(canary) == 2 and len(stable) == 2
    # Same weights (nothing to fetch), the new config on the canary only.
    assert {i["model"]["digest"] for i in canary} == {i["model"]["digest"] for i in stable}
    assert all(i["engine_config"] == config for i in canary)
    assert all(i["engine_config"] != config for i in stable)
    # The same config again is the same tag: registered once.
    assert api.as_admin("POST", f"{V}/deployments/web/rollout/abort", json={}).is_success
    tick(api)
    again = start(api, to=None, engine_config=config, steps=[50, 100])
    assert again.status_code == 201 and again.json()["to"] == to
    full = api.as_admin("POST", f"{V}/deployments/web/rollout/promote", json={"full": True})
    assert full.status_code == 200
    for _ in range(6):
        ready_round(api, agent)
    assert status(api).state == RolloutState.PROMOTED
    shown = api.as_admin("GET", f"{V}/deployments/web").json()
    assert shown["engine_config"] == config and shown["version"] == to.split(":")[1]


def test_an_extended_step_keeps_the_data_it_had(api: Api, fleet: tuple[str, str]) -> None:
    agent, gateway = fleet
    assert start(api, steps=[50, 100]).status_code == 201
    tick(api)
    ready_round(api, agent)
    serve_interval(api, agent, gateway, stable=(1, 0), canary=(1, 0))  # 6 + 6: too few
    out = status(api)
    assert [a.verdict for a in out.analyses] == ["inconclusive"]
    serve_interval(api, agent, gateway, stable=(1, 0), canary=(1, 0))  # 12 + 12 over both
    out = status(api)
    assert [a.verdict for a in out.analyses] == ["inconclusive", "pass"]
    assert (out.analyses[1].canary_requests, out.analyses[1].since) == (
        12, out.analyses[0].since,
    )  # fmt: skip


def test_the_new_snapshot_is_pre_staged_on_every_host_first(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    assert start(api).status_code == 201
    reply = beat(api, agent, advertise_address=ADDRESS)
    assert [r["digest"] for r in reply["prefetch"]] == [V2_DIGEST]
    tick(api, held=(V1_DIGEST,))
    out = status(api)
    assert (out.phase, out.step, out.canary_instances) == (RolloutPhase.STAGING, 0, 0)
    assert [(s.host, s.state) for s in out.staging] == [("gpu-1", "fetching")]
    assert "waiting for gpu-1" in out.reason and versions(api) == {"v1": 4}
    tick(api)  # now it holds v2
    out = status(api)
    assert (out.phase, out.canary_instances) == ("waiting", 1)


def test_a_host_that_cannot_verify_the_snapshot_pauses_the_rollout(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    assert start(api).status_code == 201
    failure = {"digest": V2_DIGEST, "error": "model.safetensors: sha256 mismatch"}
    beat(api, agent, advertise_address=ADDRESS,
         facts={"snapshots": [V1_DIGEST], "snapshot_failures": [failure]})  # fmt: skip
    controller(api).tick(api.clock())
    out = status(api)
    assert (out.state, out.phase) == (RolloutState.PAUSED, RolloutPhase.STAGING)
    assert "gpu-1" in out.reason and "model.safetensors" in out.reason
    assert versions(api) == {"v1": 4}  # nothing moved


def test_surge_runs_the_canary_beside_a_single_instance_where_gpus_are_free(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    one = api.as_admin(
        "PATCH", f"{V}/deployments/web", json={"instances_per_host": 1, "gpus_per_instance": 4}
    )
    assert one.status_code == 200, one.text
    report(api, agent)
    made = start(api, surge=1, steps=[50, 100])
    assert made.status_code == 201, made.text
    tick(api)
    # The canary is an extra instance on the 4 free GPUs; the stable one keeps serving.
    assert versions(api) == {"v1": 1, "v2": 1}
    gpus = [
        i["gpu_indices"] for i in api.as_admin("GET", f"{V}/deployments/web").json()["instances"]
    ]
    assert sorted(gpus) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    full = api.as_admin("POST", f"{V}/deployments/web/rollout/promote", json={"full": True})
    assert full.status_code == 200
    for _ in range(6):
        ready_round(api, agent)
    assert status(api).state == RolloutState.PROMOTED
    assert versions(api) == {"v2": 1}  # the surge instance is gone again
    # No room for another instance: refused, saying why.
    wide = api.as_admin("PATCH", f"{V}/deployments/web", json={"gpus_per_instance": 8})
    assert wide.status_code == 200, wide.text
    report(api, agent)
    refused = start(api, to="v1", surge=1)
    assert refused.status_code == 422 and "--surge 1" in refused.json()["message"]
    assert "GPU" in refused.json()["message"]


def test_a_host_may_download_the_version_it_pre_stages_and_no_other(
    api: Api, fleet: tuple[str, str]
) -> None:
    agent, _gateway = fleet
    other = api.register("gpu-2")["agent_token"]  # a host that serves no instance of web
    path = f"{V}/models/demo/versions/v2/files/config.json"
    assert api.call("GET", path, agent).status_code == 403
    assert start(api).status_code == 201  # staging: no instance runs v2 yet
    assert api.call("GET", path, agent).status_code != 403
    assert api.call("GET", path, other).status_code == 403


def test_a_starved_canary_pauses_the_rollout_and_shows_the_split_it_got(
    api: Api, fleet: tuple[str, str]
) -> None:
    # Weight 25, but the gateways' passive health ejects the canary: 2 requests in 100 reach it.
    agent, gateway = fleet
    assert start(api, canary=25).status_code == 201
    tick(api)
    ready_round(api, agent)
    assert status(api).served is None  # no request yet

    def starved_rounds(rounds: int) -> None:
        # Each a sixth of an interval in which 2 requests in 100 reach the canary.
        for _ in range(rounds):
            api.clock.advance(INTERVAL / 6)
            report(api, agent)
            traffic(api, gateway, stable=(98, 0), canary=(2, 0))
            tick(api)

    starved_rounds(3)
    out = status(api)
    assert (out.state, out.weight) == (RolloutState.PROGRESSING, 25)
    assert out.served == pytest.approx(0.02)  # beside the weight, before any analysis
    starved_rounds(3)
    out = status(api)
    # Starved once: held another interval (the gateways may lag a canary just ready).
    assert (out.state, out.step, out.weight) == (RolloutState.PROGRESSING, 1, 25)
    assert out.analysis is not None and out.analysis.verdict == "starved"
    assert "extended" in out.reason and "12 of 600 requests" in out.reason
    starved_rounds(6)
    out = status(api)
    # Starved twice running: not judged on so little, not extended forever: paused for the
    # operator, saying why.
    assert (out.state, out.step, out.weight) == (RolloutState.PAUSED, 1, 25)
    assert out.analysis is not None and out.analysis.verdict == "starved"
    assert "starved" in out.reason and "12 of 600 requests (2%) at weight 25%" in out.reason
    share = {m.metric: m for m in out.analysis.metrics}["served share"]
    assert (share.unit, share.verdict, share.canary) == ("ratio", "starved", pytest.approx(0.02))
    events = api.as_admin("GET", f"{V}/events", params={"kind": "rollout.paused"}).json()
    assert any("starved" in e["message"] for e in events["items"])
    # Resumed, a canary served its weight is judged as usual.
    resumed = api.as_admin("POST", f"{V}/deployments/web/rollout/resume", json={})
    assert resumed.status_code == 200, resumed.text
    serve_interval(api, agent, gateway, stable=(75, 0), canary=(25, 0))
    out = status(api)
    assert out.state == RolloutState.PROGRESSING and out.analysis is not None
    assert out.analysis.verdict == "pass" and out.step == 2
