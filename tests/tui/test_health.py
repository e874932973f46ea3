"""The TUI's pure rules: colours from thresholds, alerts, the stale banner, formatting, traffic
summaries and `:` completion. No screen: data in, decision out."""

from __future__ import annotations

from datetime import timedelta

import pytest

from protocol.gateway import DeploymentTraffic
from protocol.rest import DeploymentOut, HostOut
from protocol.rollout_states import RolloutState
from tests.tui import canned
from tui import format as fmt
from tui import health
from tui.commands import complete, resolve
from tui.health import Thresholds
from tui.link import Link
from tui.traffic import request_rates, summarize

LIMITS = Thresholds()


def test_states_map_to_colours() -> None:
    assert [health.host_state(s) for s in ("ready", "not_ready", "unreachable")] == [
        "ok",
        "warn",
        "bad",
    ]
    assert health.host_state("ready", draining=True) == "warn"
    assert health.instance_state("ready") == "ok"
    assert health.instance_state("starting") == "warn"
    assert health.instance_state("crash_loop") == "bad"
    assert health.instance_state("stopped") == "idle"
    assert [health.verdict(v) for v in ("pass", "fail", "inconclusive", "starved")] == [
        "ok", "bad", "warn", "warn"
    ]  # fmt: skip
    assert health.rollout_state(RolloutState.PROMOTED) == "ok"
    assert health.rollout_state(RolloutState.ABORTED) == "bad"


@pytest.mark.parametrize(
    ("ready", "total", "level"), [(2, 2, "ok"), (1, 2, "warn"), (0, 2, "bad"), (0, 0, "idle")]
)
def test_ready_ratio(ready: int, total: int, level: str) -> None:
    assert health.ready_ratio(ready, total) == level


def test_thresholds_turn_figures_yellow_then_red() -> None:
    gib = 2**30
    assert health.gpu_memory(50 * gib, 100 * gib, LIMITS) == "ok"
    assert health.gpu_memory(80 * gib, 100 * gib, LIMITS) == "warn"  # at the threshold
    assert health.gpu_memory(96 * gib, 100 * gib, LIMITS) == "bad"
    assert health.gpu_memory(0, 0, LIMITS) == "idle"
    assert health.gpu_temperature(None, LIMITS) == "idle"  # N/A is not a health signal
    assert health.gpu_temperature(85, LIMITS) == "warn"
    assert health.error_rate(0.002, LIMITS) == "ok"
    assert health.error_rate(0.06, LIMITS) == "bad"
    assert health.latency(3.0, Thresholds(p95_warn_s=1.0, p95_bad_s=2.0)) == "bad"
    assert health.ecc(0) == "ok" and health.ecc(2) == "bad" and health.ecc(None) == "idle"


def test_heartbeat_age_counts_in_the_hosts_own_intervals() -> None:
    assert health.heartbeat(4, 5.0, LIMITS) == "ok"
    assert health.heartbeat(15, 5.0, LIMITS) == "warn"
    assert health.heartbeat(50, 5.0, LIMITS) == "bad"
    assert health.heartbeat(None, 5.0, LIMITS) == "bad"  # never heard from


def test_alerts_name_crash_loops_hosts_preflight_and_snapshots_red_first() -> None:
    failed = {"digest": "ab" * 32, "error": "model.safetensors: sha256 mismatch"}
    first = canned.HOSTS[0]
    broken = {**first, "facts": {**first["facts"], "snapshot_failures": [failed]}}
    hosts = [HostOut.model_validate(h) for h in (broken, *canned.HOSTS[1:])]
    looping = dict(canned.DEPLOYMENT)
    looping["instances"] = [canned.instance(7, "gpu-2", "v1", "crash_loop", restarts=9)]
    found = health.alerts(hosts, [DeploymentOut.model_validate(looping)])
    texts = [f"{a.subject}: {a.text}" for a in found]
    assert "gpu-3: host not_ready" in texts
    assert "gpu-3: preflight disk failed: 2 GiB free" in texts
    assert "web/7: crash loop on gpu-2 (9 restarts)" in texts
    assert any(t.startswith("gpu-1: snapshot abababababab failed verification") for t in texts)
    assert [a.level for a in found] == sorted((a.level for a in found), key=lambda x: x != "bad")


def test_banner_says_unreachable_or_slow_with_the_age_and_goes_when_a_refresh_works() -> None:
    link, now = Link(), canned.NOW
    assert link.banner(now, None, 2.0) is None
    link.succeeded(now - timedelta(seconds=14))
    link.failed("cannot reach the control plane")
    shown = link.banner(now, None, 2.0)
    assert shown == "control plane unreachable — data from 14 s ago: cannot reach the control plane"
    link.succeeded(now)
    assert link.banner(now, None, 2.0) is None
    assert link.banner(now, now - timedelta(seconds=1), 2.0) is None  # waiting, not yet slow
    slow = link.banner(now + timedelta(seconds=7), now, 2.0)
    assert slow == "control plane slow — data from 7 s ago"
    assert (
        health.stale_banner(None, "refused", False)
        == "control plane unreachable — no data yet: refused"
    )


def test_formats() -> None:
    assert [fmt.duration(s) for s in (45, 252, 3720, 90000)] == ["45s", "4m12s", "1h02m", "1d01h"]
    assert fmt.duration(None) == "-"
    assert fmt.size(1536 * 2**20) == "1.5 GiB" and fmt.size(None) == "N/A"
    assert fmt.optional(None, " W") == "N/A" and fmt.optional(512.0, " W") == "512 W"
    assert fmt.bar(0.6, 10) == "██████░░░░"
    assert fmt.bar(None, 5) == "N/A  "
    assert fmt.sparkline([0, 50, 100], top=100) == "▁▅█"
    assert fmt.sparkline([]) == ""
    assert fmt.metric("ratio", 0.0025) == "0.25%"
    assert fmt.metric("seconds", 0.41) == "410 ms"
    assert fmt.metric("count", 1.0) == "1"
    assert fmt.metric("number", 2.125) == "2.12"
    assert fmt.served(20, 0.02) == "20% (served 2%)" and fmt.served(20, None) == "20%"


def test_traffic_summary_over_versions() -> None:
    traffic = DeploymentTraffic.model_validate(canned.traffic())
    figures = summarize(traffic)
    assert figures.requests_per_s == pytest.approx(1000 / 300)
    assert figures.error_rate == pytest.approx(2 / 1000)
    assert figures.p95_s == pytest.approx(0.47)  # the worse version's
    assert figures.tokens_per_forward == pytest.approx((900 * 2.1 + 100 * 2.3) / 1000)
    assert summarize(None).requests_per_s is None
    assert request_rates(traffic)[2][:3] == [0.2, 0.3, 0.4]  # demo:v2


def test_command_completion() -> None:
    assert complete("dep") == "deployments"
    assert complete("ev") == "events"
    assert complete("") == ""  # every name: their common prefix is empty
    assert complete("zzz") == "zzz"
    assert resolve("ho") == "hosts" and resolve("hosts") == "hosts"
    assert resolve("nope") is None
