"""Rollouts, rollbacks and restarts with real processes: the CLI drives a real control plane,
whose controller moves real engines (through a real agent) and sets the weight a real gateway
routes by, under a steady load of client requests. The tests share one fleet, in file order."""

from __future__ import annotations

import json
import math
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from protocol.rollout_states import RolloutState
from protocol.rollouts import RolloutOut
from tests.agent_e2e.conftest import wait_for
from tests.rollout_e2e.conftest import BASE_CONFIG, RolloutFleet

INTERVAL_S = 6


def status(ro: RolloutFleet) -> RolloutOut:
    result = ro.dctl("rollout", "status", "demo", "--json")
    assert result.returncode == 0, result.stderr
    return RolloutOut.model_validate(json.loads(result.stdout))


def config_file(tmp_path: Path, name: str, **changes: dict[str, object]) -> Path:
    """BASE_CONFIG with some sections changed, as a YAML file (JSON is YAML)."""
    config = {k: dict(v) for k, v in BASE_CONFIG.items()}
    for section, values in changes.items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def fetches(ro: RolloutFleet) -> float:
    """The agent's count of snapshot fetches (every result)."""
    port = (ro.fleet.stack.agent_data() / "agent" / "metrics-port").read_text().strip()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dctl_agent_snapshot_fetches_total"
    )


def test_a_good_version_goes_10_50_100_and_is_promoted(rollout_fleet: RolloutFleet) -> None:
    ro = rollout_fleet
    start = time.monotonic()
    # This test is about the steps, the split and the promotion, not the latency gate (unit
    # tests in tests/controlplane judge that): two engines, an agent, a gateway, a control
    # plane and the load share two cores with other test workers here, and CI once saw the
    # canary's p95 at 3.5x stable's for two intervals (88 ms against 24 ms) on the same
    # weights. So its latency limits are far above anything scheduling noise reaches.
    result = ro.dctl(
        "rollout", "demo", "--to", "demo:v2", "--steps", "10,50,100",
        "--interval", f"{INTERVAL_S}s", "--min-requests", "20",
        "--max-latency-ratio", "20", "--max-ttft-ratio", "20", "--wait", timeout=400,
    )  # fmt: skip
    if result.returncode:
        for a in ro.load.since(start):
            if a.version == "demo:v2" or a.seconds > 0.3:
                print(f"{a.time - start:7.2f} {a.version} {a.status} {a.seconds:.3f}")
    assert result.returncode == 0, result.stdout[-3000:]
    out = status(ro)
    assert (out.state, out.from_, out.to) == (RolloutState.PROMOTED, "demo:v1", "demo:v2")
    # Each analysed step saw the split its weight asks for: the clients' answers from 1.5 s
    # after the step started (gateways poll the routing table every second) to its analysis.
    for analysis in out.analyses:
        assert analysis.verdict == "pass", analysis
        since, until = analysis.since.timestamp() + 1.5, analysis.time.timestamp()
        served = Counter(a.version for a in ro.load.answers if since <= a.wall <= until)
        n = served["demo:v2"] + served["demo:v1"]
        share = 100 * served["demo:v2"] / n
        # Each request picks its pool at random: four standard deviations of that binomial,
        # and two points for the window's edges (answers still in flight when it closes).
        sigma = 100 * math.sqrt(analysis.weight / 100 * (1 - analysis.weight / 100) / n)
        assert abs(share - analysis.weight) <= 4 * sigma + 2, (analysis.weight, share, served)
    assert [a.weight for a in out.analyses] == [10, 50]
    answers = ro.load.since(start)
    assert answers and all(a.status == 200 for a in answers), [
        a for a in answers if a.status != 200
    ][:5]
    ro.all_ready("v2")
    assert ro.api.get_deployment("demo").version == "v2"


def wait_state(ro: RolloutFleet, want: set[str], timeout_s: float = 120) -> RolloutOut:
    def probe() -> RolloutOut | None:
        out = status(ro)
        return out if out.state in want else None

    try:
        return wait_for(f"rollout state in {want}", probe, timeout_s)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{ro.fleet.stack.diagnostics()}") from None


def wait_weight(ro: RolloutFleet, timeout_s: float = 120) -> RolloutOut:
    return wait_for(
        "the canary to get traffic", lambda: (o := status(ro)).weight > 0 and o, timeout_s
    )


def test_a_canary_answering_half_with_errors_is_aborted(
    rollout_fleet: RolloutFleet, tmp_path: Path
) -> None:
    ro = rollout_fleet
    bad = config_file(tmp_path, "bad.yaml", chaos={"error_rate": 0.5})
    result = ro.dctl(
        "rollout", "demo", "--to", "demo:v3", "--engine-config", str(bad), "--canary", "20%",
        "--interval", f"{INTERVAL_S}s", "--min-requests", "20", "--failure-limit", "2",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    wait_weight(ro)
    weighted = time.monotonic()
    out = wait_state(ro, {RolloutState.ABORTED, RolloutState.PROMOTED})
    assert out.state == RolloutState.ABORTED and "error rate" in out.reason, out.reason
    # Server times: from the step's start (the canary ready and weighted) to the abort: two
    # failing intervals, one more for a first interval the gateways' routing lag starved, and
    # one of slack.
    took = (out.updated_at - out.analyses[0].since).total_seconds()
    assert took <= INTERVAL_S * 4 + 2, [(str(a.time), a.verdict) for a in out.analyses]
    answers = ro.load.since(weighted)
    assert any(a.status == 500 and a.version == "demo:v3" for a in answers)
    stable = [a for a in answers if a.version == "demo:v2"]
    assert stable and all(a.status == 200 for a in stable)
    ro.all_ready("v2")


def test_a_canary_decoding_with_twice_the_steps_is_aborted(
    rollout_fleet: RolloutFleet, tmp_path: Path
) -> None:
    ro = rollout_fleet
    slow = config_file(tmp_path, "slow.yaml", model={"steps": 4})
    # Engines' figures reach the store in 10 s buckets labelled by their start: an interval
    # of 25 s holds at least one whole bucket that started after it did.
    result = ro.dctl(
        "rollout", "demo", "--to", "demo:v3", "--engine-config", str(slow), "--canary", "20%",
        "--interval", "25s", "--min-requests", "20", "--failure-limit", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    start = time.monotonic()
    out = wait_state(ro, {RolloutState.ABORTED, RolloutState.PROMOTED})
    assert out.state == RolloutState.ABORTED and "steps per block" in out.reason, out.reason
    by_metric = {m.metric: m for m in out.analyses[-1].metrics}
    assert by_metric["error rate"].verdict == "pass"
    steps = by_metric["steps per block"]
    assert steps.stable and steps.canary and steps.canary == 2 * steps.stable
    assert all(a.status == 200 for a in ro.load.since(start))
    ro.all_ready("v2")


def test_rollback_moves_every_instance_back_without_fetching(rollout_fleet: RolloutFleet) -> None:
    ro = rollout_fleet
    fetched = fetches(ro)
    start = time.monotonic()
    result = ro.dctl("rollback", "demo", "--reason", "e2e")
    took = time.monotonic() - start
    assert result.returncode == 0, result.stdout + result.stderr
    ro.all_ready("v1")
    assert fetches(ro) == fetched  # the hosts kept demo:v1's snapshot
    assert took < 120, took
    assert all(a.status == 200 for a in ro.load.since(start))
    out = status(ro)
    assert (out.kind, out.state, out.to) == ("rollback", RolloutState.ROLLED_BACK, "demo:v1")


def test_a_rolling_restart_under_traffic_fails_no_request(rollout_fleet: RolloutFleet) -> None:
    ro = rollout_fleet
    before = {i.id: i.pid for i in ro.api.get_deployment("demo").instances}
    start = time.monotonic()
    result = ro.dctl("restart", "demo")
    assert result.returncode == 0, result.stdout + result.stderr
    ro.all_ready("v1")
    after = {i.id: i.pid for i in ro.api.get_deployment("demo").instances}
    assert before.keys() == after.keys() and all(before[i] != after[i] for i in before)
    answers = ro.load.since(start)
    assert len(answers) > 50 and all(a.status == 200 for a in answers), [
        a for a in answers if a.status != 200
    ][:5]
    assert (status(ro).kind, status(ro).state) == ("restart", RolloutState.COMPLETED)


def test_the_control_plane_killed_mid_step_resumes_the_step(rollout_fleet: RolloutFleet) -> None:
    ro = rollout_fleet
    stack = ro.fleet.stack
    result = ro.dctl("rollout", "demo", "--to", "v2", "--canary", "50", "--interval", "60s")
    assert result.returncode == 0, result.stdout + result.stderr
    again = ro.dctl("rollout", "demo", "--to", "v3")
    assert again.returncode == 1 and "already has an active rollout" in again.stderr
    out = wait_weight(ro)
    assert out.step == 1 and out.time_left_s is not None
    assert stack.server is not None
    stack.server.send_signal(signal.SIGKILL)
    stack.server.wait()
    killed = time.monotonic()
    time.sleep(3)
    stack.start_server()
    restarted = time.monotonic()
    left = out.time_left_s

    def resumed() -> RolloutOut | None:
        # Once the new process holds the controllers' lease (the dead one's hold runs out
        # first), its first round takes the time without a leader off the step's clock. A
        # status call can take seconds on a loaded machine, so the step may have run on since
        # the restart: it must have lost no more than that, never the time it was down.
        asked = time.monotonic()
        now = status(ro)
        assert (now.state, now.step, now.weight) == (RolloutState.PROGRESSING, 1, 50), now
        if now.time_left_s is None:
            return None
        return now if now.time_left_s >= left - 4 - (asked - restarted) else None

    out_after = wait_for("the step to resume with the time it had left", resumed, 60)
    assert time.monotonic() - killed > 4  # it really was down, and is back at the same point
    # At most one controller round (1 s) more: the gap counts from the last round before the
    # kill, a little before `left` was read.
    assert out_after.time_left_s is not None and out_after.time_left_s <= left + 1.0
    aborted = ro.dctl("rollout", "abort", "demo", "--reason", "e2e done")
    assert aborted.returncode == 0, aborted.stderr
    ro.all_ready("v1")
