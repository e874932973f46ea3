"""`dctl rollout`, `rollback`, `restart`: argument handling, rendering and exit codes.

The commands talk to a loopback HTTP server that answers the rollout endpoints from canned
records (the control plane's side is tested in tests/controlplane), and once to a real
`dctl server` for the not-found path.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

import cli.cmd_rollout as cmd_rollout
from cli.exits import FAILURE, OK, USAGE
from cli.rollout_view import exit_code, progress_lines, status_text
from protocol.rollout_states import RolloutPhase, RolloutState
from protocol.rollouts import RolloutOut
from protocol.vocabulary import ROLLOUT_SUBCOMMANDS
from tests.cli.canned_api import CannedApi
from tests.cli.conftest import Dctl, Result, Server
from tests.clock import FakeClock

T0 = datetime(2025, 5, 1, 12, 0, tzinfo=UTC)
BASE = "/api/v1/deployments/demo"


def record(**changes: Any) -> dict[str, Any]:
    """A rollout record as the API sends it (`from`, not `from_`)."""
    doc: dict[str, Any] = {
        "id": 7,
        "deployment": "demo",
        "kind": "rollout",
        "state": RolloutState.PROGRESSING,
        "step": 2,
        "steps": [10, 50, 100],
        "weight": 50,
        "from": "demo:v1",
        "to": "demo:v2",
        "engine_config_changed": True,
        "phase": RolloutPhase.ANALYSING,
        "canary_instances": 1,
        "canary_ready": 1,
        "stable_ready": 2,
        "step_started_at": T0.isoformat(),
        "time_left_s": 252.4,
        "policy": {"interval_s": 300.0},
        "analysis": {
            "time": T0.isoformat(),
            "step": 2,
            "weight": 50,
            "since": T0.isoformat(),
            "verdict": "fail",
            "stable_requests": 120,
            "canary_requests": 40,
            "metrics": [
                metric("error rate", "ratio", 0.004, 0.012, "<= stable + 0.01", "pass"),
                metric("p95 latency", "seconds", 0.85, 1.2, "<= 1.25x stable", "fail"),
                metric("steps per block", "number", 4.0, None, "<= 1.15x stable", "inconclusive"),
                metric("canary restarts", "count", None, 0.0, "0", "pass"),
            ],
        },
        "reason": "",
        "actor": "admin",
        "instances": [
            instance(1, "host-a", "demo:v1", "stable"),
            instance(2, "host-b", "demo:v1", "stable"),
            instance(3, "host-a", "demo:v2", "canary"),
        ],
        "created_at": T0.isoformat(),
        "updated_at": T0.isoformat(),
    }
    return doc | changes


def metric(
    name: str, unit: str, stable: float | None, canary: float | None, limit: str, verdict: str
) -> dict[str, Any]:
    note = "no figures" if verdict == "inconclusive" else ""
    return {"metric": name, "unit": unit, "stable": stable, "canary": canary, "limit": limit,
            "verdict": verdict, "note": note}  # fmt: skip


def instance(id: int, host: str, version: str, pool: str, ready: bool = True) -> dict[str, Any]:
    state = "ready" if ready else "starting"
    return {
        "id": id,
        "host": host,
        "version": version,
        "pool": pool,
        "state": state,
        "ready": ready,
        "restarts": 0,
    }


# --- a loopback control plane with canned answers -----------------------------------------------


@pytest.fixture(autouse=True)
def no_poll_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waits' period (POLL_S) 0: the tests never sleep."""
    monkeypatch.setattr(cmd_rollout, "POLL_S", 0.0)


def error(result: Result, code: int) -> str:
    assert result.code == code, (result.code, result.stdout, result.stderr)
    return result.stderr


# --- the group: a subcommand, else the deployment of `start` ------------------------------------


def test_help_lists_the_subcommands_and_explains_the_start_form(offline: Dctl) -> None:
    result = offline("rollout", "--help")
    assert result.code == OK
    listed = result.stdout.split("Commands:")[1]
    # `start` is the hidden explicit form of `dctl rollout DEPLOYMENT`.
    assert [line.split()[0] for line in listed.splitlines() if line.strip()] == [
        c for c in ROLLOUT_SUBCOMMANDS if c != "start"
    ]
    assert "dctl rollout DEPLOYMENT --to" in " ".join(result.stdout.split())
    assert "--interval" in offline("rollout", "demo", "--help").stdout


def test_the_subcommands_are_the_names_the_server_refuses_for_deployments() -> None:
    group = cmd_rollout.rollout_app.registered_commands
    assert {c.name for c in group} == set(ROLLOUT_SUBCOMMANDS)


def test_without_to_or_engine_config_it_is_a_usage_error_naming_both(offline: Dctl) -> None:
    stderr = error(offline("rollout", "demo", "--canary", "10%"), USAGE)
    assert "a new version (to), a new engine_config, or both" in stderr  # the request model's


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--canary", "150"], "canary: Input should be less than or equal to 99"),
        (["--canary", "0%"], "canary: Input should be greater than or equal to 1"),
        (["--canary", "ten"], "--canary 'ten'"),
        (["--steps", "10,50,90"], "the last step must be 100"),
        (["--steps", "50,10,100"], "must rise"),
        (["--steps", "10,x"], "--steps '10,x'"),
        (["--interval", "5x"], "--interval '5x'"),
        (["--max-latency-ratio", "0"], "max_latency_ratio"),
        (["--notify", "ftp://x"], "notify"),
    ],
)
def test_bad_start_options_exit_2_before_any_request(
    offline: Dctl, args: list[str], needle: str
) -> None:
    stderr = error(offline("rollout", "demo", "--to", "demo:v2", *args), USAGE)
    assert needle in stderr and "Traceback" not in stderr


# --- starting and following ---------------------------------------------------------------------


def test_start_sends_the_plan_and_prints_a_summary(run: Dctl, canned: CannedApi) -> None:
    canned.on("POST", f"{BASE}/rollout", (201, record(step=0, weight=0, analysis=None)))
    result = run(
        "rollout",
        "demo",
        "--to",
        "demo:v2",
        "--canary",
        "10%",
        "--interval",
        "5m",
        "--max-latency-ratio",
        "1.3",
        "--reason",
        "new weights",
    )
    assert result.code == OK, result.stderr
    [body] = canned.bodies("POST", f"{BASE}/rollout")
    assert body["to"] == "demo:v2" and body["canary"] == 10 and body["steps"] is None
    assert body["policy"]["interval_s"] == 300 and body["policy"]["max_latency_ratio"] == 1.3
    # Thresholds not given stay unset, so the deployment's policy applies.
    assert body["policy"]["max_ttft_ratio"] is None and body["reason"] == "new weights"
    assert "rollout 7 of demo started: demo:v1 -> demo:v2" in result.stdout
    assert "10% -> 50% -> 100%, 5m per step" in result.stdout
    assert "dctl rollout status demo --watch" in result.stdout


def test_explicit_start_and_a_bare_percent_work_too(run: Dctl, canned: CannedApi) -> None:
    canned.on("POST", f"{BASE}/rollout", (201, record()))
    assert run("rollout", "start", "demo", "--to", "v2", "--canary", "25").code == OK
    assert canned.bodies("POST", f"{BASE}/rollout")[0]["canary"] == 25


@pytest.mark.parametrize(
    ("final", "code"), [(RolloutState.PROMOTED, OK), (RolloutState.ABORTED, FAILURE)]
)
def test_wait_follows_it_to_the_end_and_exits_by_its_state(
    run: Dctl, canned: CannedApi, final: str, code: int
) -> None:
    canned.on("POST", f"{BASE}/rollout", (201, record(step=1, weight=10)))
    canned.on(
        "GET",
        f"{BASE}/rollouts/7",
        (200, record()),
        (
            200,
            record(state=final, reason="p95 latency (s) 1.41 vs stable 1 (limit <= 1.25x stable)"),
        ),
    )
    result = run("rollout", "demo", "--to", "v2", "--wait")
    assert result.code == code, result.stderr
    assert f"state:     {final}" in result.stdout


def test_watch_in_a_pipe_prints_a_block_per_change_only(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", f"{BASE}/rollout", (200, record(time_left_s=10.0)))
    canned.on(
        "GET",
        f"{BASE}/rollouts/7",
        (200, record(time_left_s=9.0)),
        (200, record(time_left_s=8.0)),
        (200, record(state=RolloutState.PROMOTED, step=3, weight=100, phase="done")),
    )
    result = run("rollout", "status", "demo", "--watch")
    assert result.code == OK, result.stderr
    # The countdown alone is no change: the first block and the final one.
    assert result.stdout.count("rollout:") == 2
    assert "state:     promoted" in result.stdout


def test_status_json_is_the_record_with_from(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", f"{BASE}/rollout", (200, record()))
    doc = json.loads(run("rollout", "status", "demo", "--json").stdout)
    assert (
        doc["from"] == "demo:v1" and doc["state"] == RolloutState.PROGRESSING and doc["step"] == 2
    )
    assert doc["analysis"]["verdict"] == "fail"


def test_actions_send_their_body(run: Dctl, canned: CannedApi) -> None:
    canned.on("POST", f"{BASE}/rollout/promote", (200, record(state=RolloutState.PROMOTED, step=3)))
    result = run("rollout", "promote", "demo", "--full", "--reason", "looks good")
    assert result.code == OK
    assert canned.bodies("POST", f"{BASE}/rollout/promote") == [
        {"reason": "looks good", "full": True}
    ]
    assert "rollout 7 of demo: promoted" in result.stdout


def test_history_is_newest_first_with_reasons_cut(run: Dctl, canned: CannedApi) -> None:
    long = "x" * 100
    canned.on(
        "GET",
        f"{BASE}/rollouts",
        (
            200,
            [
                record(id=9, kind="rollback", state=RolloutState.ROLLED_BACK, reason=long),
                record(id=7, state=RolloutState.ABORTED),
            ],
        ),
    )
    result = run("rollout", "history", "demo", "--limit", "5")
    assert result.code == OK
    assert canned.requests[-1][1].endswith("?limit=5")
    rows = result.stdout.splitlines()[1:]
    assert rows[0].startswith("9") and rows[1].startswith("7")
    assert "x" * 57 + "..." in rows[0] and long not in result.stdout
    full = json.loads(run("rollout", "history", "demo", "--json").stdout)
    assert full[0]["reason"] == long


def test_rollback_waits_printing_progress(run: Dctl, canned: CannedApi) -> None:
    start = record(
        id=9,
        kind="rollback",
        steps=[100],
        step=1,
        weight=100,
        analysis=None,
        phase=RolloutPhase.RESTARTING,
        instances=[
            instance(1, "host-a", "demo:v2", "stable"),
            instance(2, "host-b", "demo:v2", "stable"),
        ],
    )
    half = start | {
        "instances": [
            instance(1, "host-a", "demo:v1", "stable"),
            instance(2, "host-b", "demo:v2", "stable"),
        ]
    }
    done = half | {
        "state": RolloutState.ROLLED_BACK,
        "phase": "done",
        "instances": [
            instance(1, "host-a", "demo:v1", "stable"),
            instance(2, "host-b", "demo:v1", "stable"),
        ],
    }
    canned.on("POST", f"{BASE}/rollback", (201, start))
    canned.on("GET", f"{BASE}/rollouts/9", (200, half), (200, done))
    result = run("rollback", "demo", "--to", "demo:v1", "--all-at-once")
    assert result.code == OK, result.stderr
    assert canned.bodies("POST", f"{BASE}/rollback") == [
        {"to": "demo:v1", "all_at_once": True, "reason": ""}
    ]
    assert "instance 1 on host-a: demo:v1 ready (2/2)" in result.stdout
    assert result.stdout.splitlines()[-2:] == [
        "rollback 9: rolled_back, done",
        "instance 2 on host-b: demo:v1 ready (2/2)",
    ]


def test_restart_no_wait_returns_with_the_id(run: Dctl, canned: CannedApi) -> None:
    canned.on("POST", f"{BASE}/restart", (201, record(id=11, kind="restart")))
    result = run("restart", "demo", "--host", "host-a", "--no-wait")
    assert result.code == OK and "restart 11 of demo started" in result.stdout
    assert canned.bodies("POST", f"{BASE}/restart")[0]["host"] == "host-a"
    assert not canned.bodies("GET", f"{BASE}/rollouts/11")


def test_an_error_answer_is_one_line_and_exit_1(run: Dctl, canned: CannedApi) -> None:
    canned.on(
        "POST",
        f"{BASE}/rollout",
        (409, {"code": "conflict", "message": "deployment demo has an active rollout (7)"}),
    )
    stderr = error(run("rollout", "demo", "--to", "v2"), FAILURE)
    assert stderr.strip() == "error: deployment demo has an active rollout (7) (HTTP 409)"


def test_status_of_an_unknown_deployment_on_a_real_server(dctl: Dctl, server: Server) -> None:
    result = dctl("rollout", "status", "nosuch")
    assert result.code == FAILURE and "(HTTP 404)" in result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr


# --- rendering and exit codes -------------------------------------------------------------------


def test_status_text_shows_the_step_the_analysis_and_the_instances() -> None:
    text = status_text(RolloutOut.model_validate(record()))
    assert "step:      2/3 at 50%" in text and "time left: 4m12s" in text
    assert "version:   demo:v1 -> demo:v2, engine config changed" in text
    assert "instances: canary 1/1 ready, stable 2/2 ready" in text
    rows = {line.split("  ")[0]: line.split() for line in text.splitlines() if "  " in line}
    assert rows["error rate"][2:4] == ["0.40%", "1.20%"]
    assert rows["p95 latency"][2:6] == ["850", "ms", "1200", "ms"]
    assert rows["p95 latency"][-2:] == ["fail", "-"]
    assert rows["steps per block"][3:5] == ["4.00", "-"]
    assert rows["steps per block"][-3:] == ["inconclusive", "no", "figures"]
    assert rows["canary restarts"][2:4] == ["-", "0"]
    assert "analysis of step 2 at 50%" in text and "fail (120 stable, 40 canary" in text
    assert "METRIC" in text and "VERDICT" in text and "POOL" in text and "RESTARTS" in text


def test_status_text_shows_the_share_the_canary_was_served_beside_its_weight() -> None:
    # Weight 50, but the gateways ejected the canary: clients got 2% of it.
    text = status_text(RolloutOut.model_validate(record(served=0.02)))
    assert "step:      2/3 at 50% (served 2%)" in text
    starved = metric("served share", "ratio", 0.98, 0.02, ">= 0.5x weight (50%)", "starved")
    text = status_text(
        RolloutOut.model_validate(
            record(analysis={**record()["analysis"], "verdict": "starved", "metrics": [starved]})
        )
    )
    rows = {line.split("  ")[0]: line.split() for line in text.splitlines() if "  " in line}
    assert rows["served share"][2:4] == ["98.00%", "2.00%"] and "starved" in rows["served share"]
    assert ": starved (120 stable, 40 canary" in text


def test_a_final_record_shows_no_countdown() -> None:
    text = status_text(
        RolloutOut.model_validate(record(state=RolloutState.PROMOTED, analysis=None))
    )
    assert "time left" not in text and "analysis" not in text


@pytest.mark.parametrize(
    ("kind", "state", "code"),
    [
        ("rollout", RolloutState.PROMOTED, OK),
        ("rollout", RolloutState.ABORTED, FAILURE),
        ("rollout", RolloutState.ROLLED_BACK, FAILURE),
        ("rollback", RolloutState.ROLLED_BACK, OK),
        ("rollback", RolloutState.PROMOTED, OK),
        ("rollback", RolloutState.ABORTED, FAILURE),
        ("restart", RolloutState.PROMOTED, OK),
        ("restart", RolloutState.COMPLETED, OK),
        ("restart", RolloutState.ABORTED, FAILURE),
    ],
)
def test_exit_code_of_a_final_state(kind: str, state: str, code: int) -> None:
    assert exit_code(RolloutOut.model_validate(record(kind=kind, state=state))) == code


def test_progress_lines_name_only_what_changed() -> None:
    before = RolloutOut.model_validate(record())
    moved = record()
    moved["instances"][2] = instance(3, "host-a", "demo:v2", "canary", ready=False)
    now = RolloutOut.model_validate(moved)
    assert progress_lines(before, now) == ["instance 3 on host-a: demo:v2 starting (2/3)"]
    assert progress_lines(now, now) == []


def test_follow_polls_on_a_fixed_period_until_final() -> None:
    records = [RolloutOut.model_validate(record(step=s)) for s in (1, 2)]
    final = RolloutOut.model_validate(record(state=RolloutState.PROMOTED, step=3))
    answers, shown, slept = [*records[1:], final], [], []
    clock = FakeClock()

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds + 0.25)  # each request takes a quarter second

    result = cmd_rollout.follow(
        records[0],
        lambda: answers.pop(0),
        lambda b, n: shown.append((b, n)),
        interval=1.0,
        clock=clock.monotonic,
        sleep=sleep,
    )
    assert result is final
    assert [(b and b.step, n.step) for b, n in shown] == [(None, 1), (1, 2), (2, 3)]
    assert slept == [1.0, 0.75]


# --- deploy configure --rollout-policy ----------------------------------------------------------


def test_a_rollout_policy_file_with_an_unknown_key_is_refused(
    offline: Dctl, tmp_path: Path
) -> None:
    bad = tmp_path / "policy.yaml"
    bad.write_text("interval_s: 120\nmax_latency: 1.3\n")
    stderr = error(offline("deploy", "configure", "demo", "--rollout-policy", str(bad)), USAGE)
    assert str(bad) in stderr and "'max_latency'" in stderr and "max_latency_ratio" in stderr


def test_configure_sends_the_policy_and_show_shows_it(
    run: Dctl, canned: CannedApi, tmp_path: Path
) -> None:
    good = tmp_path / "policy.json"
    good.write_text(json.dumps({"interval_s": 120, "failure_limit": 3}))
    deployment = {
        "id": 1,
        "name": "demo",
        "model": "demo",
        "version": "v1",
        "placement": {"hosts": ["host-a"]},
        "instances_per_host": 1,
        "engine_config": {},
        "created_at": T0.isoformat(),
        "updated_at": T0.isoformat(),
        "instances": [],
        "rollout_policy": {"interval_s": 120.0, "failure_limit": 3},
    }
    canned.on("PATCH", BASE, (200, deployment))
    canned.on("GET", BASE, (200, deployment))
    result = run("deploy", "configure", "demo", "--rollout-policy", str(good))
    assert result.code == OK and "rollout policy updated" in result.stdout
    assert canned.bodies("PATCH", BASE) == [
        {"rollout_policy": {"interval_s": 120.0, "failure_limit": 3}}
    ]
    shown = run("deploy", "show", "demo").stdout
    assert "rollout policy: interval_s=120.0, failure_limit=3" in shown


def test_configure_without_a_change_names_all_three_flags(offline: Dctl) -> None:
    stderr = error(offline("deploy", "configure", "demo"), USAGE)
    assert all(f in stderr for f in ("--engine-config", "--gpus-per-instance", "--rollout-policy"))


def test_a_rollback_that_ends_an_active_rollout_is_a_success() -> None:
    from cli.rollout_view import exit_code

    ended = RolloutOut.model_validate(record(kind="rollout", state=RolloutState.ROLLED_BACK))
    assert exit_code(ended, rollback=True) == 0
    assert exit_code(ended) == 1  # but `rollout --wait` on it failed to promote
