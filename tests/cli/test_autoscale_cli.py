"""`dctl deploy autoscale`, and autoscaling in `deploy show` and `deploy list`: the flags read
into the policy sent, refusals before any request, and what an operator reads back.

The commands talk to a loopback server with canned answers (`tests.cli.canned_api`), built from
the REST models; `test_autoscale_end_to_end_on_a_real_control_plane` runs them against
`dctl server`."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from cli.autoscale_view import decision_text, pinned_text, policy_text, replicas_text, summary
from cli.cmd_autoscale import AUTOSCALE_FLAGS
from cli.exits import OK, USAGE
from client import ControlPlaneClient
from protocol.autoscale import AutoscaleDecision, AutoscalePolicy, AutoscaleStatus
from protocol.rest import DeploymentOut
from protocol.wire import Manifest
from tests.cli.canned_api import CannedApi
from tests.cli.conftest import Dctl, Result, Server
from tests.cli.hosts import register_host
from tests.doctor.builders import autoscaled, deployment, instance

PATH = "/api/v1/deployments/web"
NOW = datetime.now(UTC)


def body(dep: DeploymentOut) -> dict[str, object]:
    return dep.model_dump(mode="json")


def busy_web(now: datetime | None = None) -> DeploymentOut:
    """`web` autoscaled 1..8 wanting 3 serving and 1 standby, pinned and starved, with a
    standby and a retiring instance beside three serving ones; its times are before NOW
    (default: the moment it is called, so "2m ago" holds however late a slow run gets here)."""
    now = now or datetime.now(UTC)
    instances = [
        instance(1, requests_running=3, requests_waiting=5),
        instance(2, requests_running=4, requests_waiting=6),
        instance(3, observed_state="starting"),
        instance(4, standby=True),
        instance(5, retiring=True, requests_running=1, requests_waiting=0),
    ]
    last = AutoscaleDecision(
        time=now - timedelta(seconds=120), action="up", from_replicas=2, to_replicas=3,
        reason="queue 5.5 per instance over 4 for 30s",
    )  # fmt: skip
    return autoscaled(
        *instances,
        policy=AutoscalePolicy(min=1, max=8, standby=1),
        replicas=3, standby=1, serving_ready=2, standby_ready=1, placed=4,
        queue_per_instance=5.5, utilization=0.9, last_decision=last,
        pinned_at_max_since=now - timedelta(minutes=12),
        starved_since=now - timedelta(minutes=4), starved_reason="no free GPU on gpu-1",
    )  # fmt: skip


def error(result: Result, code: int) -> str:
    assert result.code == code, (result.code, result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# --- flags -> the policy sent ---------------------------------------------------------------------


def test_the_flags_are_the_policy_sent_over_the_defaults(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", PATH, (200, body(deployment(instance(1)))))
    canned.on("PUT", f"{PATH}/autoscale", (200, body(busy_web())))
    result = run("deploy", "autoscale", "web", "--min", "2", "--max", "6",
                 "--target-queue", "3", "--target-utilization", "0.5", "--up-after", "45s",
                 "--down-after", "15m", "--cooldown", "1m", "--standby", "1",
                 "--cold-start-timeout", "90s")  # fmt: skip
    assert result.code == OK, result.stderr
    [sent] = canned.bodies("PUT", f"{PATH}/autoscale")
    assert sent == {"min": 2, "max": 6, "target_queue": 3.0, "target_utilization": 0.5,
                    "up_after_s": 45.0, "down_after_s": 900.0, "cooldown_s": 60.0,
                    "standby": 1, "cold_start_timeout_s": 90.0}  # fmt: skip
    # What came back, in one paragraph: the counts, the policy, where it stands.
    assert result.stdout.startswith("deployment web autoscales 1/3/8 +1 standby (min/current/max")
    assert "down when under 50% of their capacity is busy" not in result.stdout  # the answer's
    assert "down when under 80% of their capacity is busy for 10m" in result.stdout
    assert "Now 2 of 3 serving ready, 1 of 1 standby ready, 5.5 waiting per instance" in (
        result.stdout
    )
    assert re.search(r"Last change: up 2->3 2m(0\ds)? ago: queue 5.5 per instance", result.stdout)
    assert "Pinned at max since" in result.stdout and "Starved: no free GPU on gpu-1" in (
        result.stdout
    )
    assert len(result.stdout.strip().splitlines()) == 1


def test_a_new_policy_takes_the_defaults_for_what_is_left_out(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", PATH, (200, body(deployment(instance(1)))))
    canned.on("PUT", f"{PATH}/autoscale", (200, body(busy_web())))
    assert run("deploy", "autoscale", "web", "--max", "4").code == OK
    [sent] = canned.bodies("PUT", f"{PATH}/autoscale")
    assert sent == AutoscalePolicy(max=4).model_dump(mode="json")


def test_options_left_out_keep_the_current_policy(run: Dctl, canned: CannedApi) -> None:
    current = AutoscalePolicy(min=2, max=6, standby=1, up_after_s=60, target_queue=2.5)
    canned.on("GET", PATH, (200, body(autoscaled(instance(1), policy=current))))
    canned.on("PUT", f"{PATH}/autoscale", (200, body(busy_web())))
    assert run("deploy", "autoscale", "web", "--max", "12", "--cooldown", "2m").code == OK
    [sent] = canned.bodies("PUT", f"{PATH}/autoscale")
    assert sent == current.model_copy(update={"max": 12, "cooldown_s": 120.0}).model_dump(
        mode="json"
    )


def test_min_above_the_current_max_is_refused_naming_where_max_came_from(
    run: Dctl, canned: CannedApi
) -> None:
    current = AutoscalePolicy(min=2, max=6)
    canned.on("GET", PATH, (200, body(autoscaled(instance(1), policy=current))))
    line = error(run("deploy", "autoscale", "web", "--min", "7"), USAGE)
    assert line == (
        "error: --min/--max: min (7) is above max (6): give min <= max; "
        "max 6 is the deployment's current value: give --max too"
    )
    assert canned.bodies("PUT", f"{PATH}/autoscale") == []


def test_with_no_option_an_autoscaled_deployment_is_only_shown(
    run: Dctl, canned: CannedApi
) -> None:
    canned.on("GET", PATH, (200, body(busy_web())))
    result = run("deploy", "autoscale", "web")
    assert result.code == OK and "autoscales 1/3/8 +1 standby" in result.stdout
    assert canned.bodies("PUT", f"{PATH}/autoscale") == []


def test_the_servers_reasons_are_printed_inert(run: Dctl, canned: CannedApi) -> None:
    web = busy_web()
    assert web.autoscale_status is not None and web.autoscale_status.last_decision is not None
    web.autoscale_status.last_decision.reason = "queue \x1b]0;owned\x07high\x1b[2J"
    web.autoscale_status.starved_reason = "no GPU\r\x1b[1A"
    canned.on("GET", PATH, (200, body(web)))
    for args in (["deploy", "autoscale", "web"], ["deploy", "show", "web"]):
        out = run(*args).stdout
        assert "\x1b" not in out and "\r" not in out and "\x07" not in out
        assert "queue high" in out and "no GPU" in out


def test_json_prints_the_deployment_the_server_returned(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", PATH, (200, body(deployment(instance(1)))))
    canned.on("PUT", f"{PATH}/autoscale", (200, body(busy_web())))
    printed = json.loads(run("deploy", "autoscale", "web", "--min", "1", "--json").stdout)
    assert printed["autoscale"]["standby"] == 1 and printed["autoscale_status"]["replicas"] == 3


def test_off_clears_the_policy(run: Dctl, canned: CannedApi) -> None:
    fixed = deployment(instance(1), instance(2), instance(3, standby=True))
    canned.on("DELETE", f"{PATH}/autoscale", (200, body(fixed)))
    result = run("deploy", "autoscale", "web", "--off")
    assert result.code == OK, result.stderr
    assert result.stdout == "deployment web: autoscaling off; it keeps its 2 serving instance(s)\n"
    assert [m for m, _, _ in canned.requests] == ["DELETE"]


def test_a_server_refusal_is_one_error_line(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", PATH, (404, {"error": "not_found", "message": "deployment web not found"}))
    line = error(run("deploy", "autoscale", "web", "--max", "4"), 1)
    assert "deployment web not found" in line


# --- refused before any request ---------------------------------------------------------------


def test_every_field_of_the_policy_has_its_flag() -> None:
    assert set(AUTOSCALE_FLAGS) == set(AutoscalePolicy.model_fields)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--min", "3", "--max", "2"], "--min/--max: min (3) is above max (2): give min <= max"),
        (["--min", "-1"], "--min -1: must be at least 0"),
        (["--max", "0"], "--max 0: must be at least 1"),
        (["--standby", "-2"], "--standby -2: must be at least 0"),
        (["--target-queue", "0"], "--target-queue 0: must be above 0"),
        (["--target-utilization", "1.5"], "--target-utilization 1.5: must be at most 1"),
        (["--up-after", "5x"], "--up-after '5x': write a positive duration like 30m, 24h or 7d"),
        (["--up-after", "2d"], "--up-after 2d: must be at most 1d"),
        (["--cold-start-timeout", "2h"], "--cold-start-timeout 2h: must be at most 1h"),
        (["--off", "--min", "1", "--cooldown", "3s"],
         "--off turns autoscaling off: leave out --min, --cooldown"),
    ],
)  # fmt: skip
def test_bad_values_are_usage_errors_naming_the_flag(
    offline: Dctl, args: list[str], message: str
) -> None:
    assert error(offline("deploy", "autoscale", "web", *args), USAGE) == f"error: {message}"


# --- deploy show and deploy list ----------------------------------------------------------------


def test_show_has_the_counts_the_last_decision_and_pinned_and_starved(
    run: Dctl, canned: CannedApi
) -> None:
    canned.on("GET", PATH, (200, body(busy_web())))
    result = run("deploy", "show", "web")
    assert result.code == OK, result.stderr
    fields = dict(
        re.split(r":\s+", line, maxsplit=1) for line in result.stdout.split("\n\n")[0].splitlines()
    )
    assert fields["autoscale"] == "1/3/8 +1 standby"
    assert fields["autoscale now"].startswith("2 of 3 serving ready, 1 of 1 standby ready")
    assert re.fullmatch(r"up 2->3 2m(0\ds)? ago: queue 5.5 per instance over 4 for 30s",
                        fields["last decision"])  # fmt: skip
    assert re.fullmatch(r"since \S+ \S+Z \(12m(0\ds)? ago\)", fields["pinned at max"])
    assert fields["starved"].startswith("no free GPU on gpu-1, since ")
    rows = {line.split()[0]: line.split() for line in result.stdout.split("\n\n")[1].splitlines()}
    header = rows["ID"]
    role, load = header.index("ROLE"), header.index("RUN/WAIT")
    assert {i: rows[i][role] for i in "12345"} == {
        "1": "serving", "2": "serving", "3": "serving", "4": "standby", "5": "retiring",
    }  # fmt: skip
    assert (rows["1"][load], rows["5"][load], rows["4"][load]) == ("3/5", "1/0", "-")


def test_show_of_a_fixed_deployment_has_no_autoscale_lines(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", PATH, (200, body(deployment(instance(1)))))
    out = run("deploy", "show", "web").stdout
    assert re.search(r"^autoscale:\s+-$", out, re.MULTILINE)
    assert "last decision" not in out and "pinned" not in out and "starved" not in out


def test_list_has_an_autoscale_column(run: Dctl, canned: CannedApi) -> None:
    fixed = deployment(instance(7)).model_copy(update={"name": "batch"})
    canned.on("GET", "/api/v1/deployments", (200, [body(busy_web()), body(fixed)]))
    lines = run("deploy", "list").stdout.splitlines()
    column = lines[0].index("AUTOSCALE")
    cells = {line.split()[0]: line[column:].split("  ")[0].strip() for line in lines[1:]}
    assert cells == {"web": "1/3/8 +1 standby", "batch": "-"}


# --- the text, stated ----------------------------------------------------------------------------


def test_counts_fall_back_to_the_serving_instances_before_the_autoscaler_speaks() -> None:
    policy = AutoscalePolicy(min=0, max=4, standby=2)
    assert replicas_text(policy, None, 1) == "0/1/4 +2 standby"
    assert replicas_text(policy, AutoscaleStatus(replicas=3), 1) == "0/3/4"
    assert replicas_text(AutoscalePolicy(), AutoscaleStatus(replicas=0), 0) == "1/0/8"


def test_decisions_and_times_read_as_an_operator_types_them() -> None:
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    down = AutoscaleDecision(time=now - timedelta(seconds=3720), action="down", from_replicas=3,
                             to_replicas=2, reason="")  # fmt: skip
    assert decision_text(down, now) == "down 3->2 1h02m ago"
    status = AutoscaleStatus(replicas=8, pinned_at_max_since=now.replace(tzinfo=None))
    assert pinned_text(status, now) == "since 2026-01-01 12:00:00Z (just now)"


def test_scale_to_zero_says_how_long_a_request_waits() -> None:
    assert "Idle, it stops its last instance" not in policy_text(AutoscalePolicy())
    text = policy_text(AutoscalePolicy(min=0, cold_start_timeout_s=150))
    assert text.endswith("a request then waits up to 2m30s while one starts.")
    fixed = deployment(instance(1), instance(2, retiring=True))
    assert summary(fixed, NOW) == "deployment web: not autoscaled, 1 serving instance(s)."


# --- against a real control plane --------------------------------------------------------------


def test_autoscale_end_to_end_on_a_real_control_plane(dctl: Dctl, server: Server) -> None:
    """Set, change, show, list, refuse and clear a policy on `dctl server` (the session's)."""
    register_host(server, dctl, "as-1", gpus=4)
    made = Manifest.model_validate(
        {"files": [{"path": "config.json", "size": 100, "sha256": "ab" * 32}]}
    )
    with ControlPlaneClient(server.url, server.admin_token) as admin:
        admin.register_version("chat", "v1", made, source_uri="/models/chat")
    created = dctl("deploy", "create", "chat", "--model", "chat:v1", "--hosts", "as-1",
                   "--gpus-per-instance", "1")  # fmt: skip
    assert created.code == OK, created.stderr
    try:
        first = dctl("deploy", "autoscale", "chat", "--min", "1", "--max", "3", "--standby", "1",
                     "--up-after", "45s", "--json")  # fmt: skip
        assert first.code == OK, first.stderr
        policy = json.loads(first.stdout)["autoscale"]
        assert policy == AutoscalePolicy(min=1, max=3, standby=1, up_after_s=45).model_dump(
            mode="json"
        )
        # Only the ceiling changes; the rest is the policy the server holds.
        raised = json.loads(dctl("deploy", "autoscale", "chat", "--max", "4", "--json").stdout)
        assert raised["autoscale"] == {**policy, "max": 4}

        refused = dctl("deploy", "autoscale", "chat", "--min", "5")
        assert refused.code == USAGE
        assert "max 4 is the deployment's current value: give --max too" in refused.stderr

        shown = dctl("deploy", "show", "chat").stdout
        assert re.search(r"^autoscale:\s+1/1/4 \+1 standby$", shown, re.MULTILINE), shown
        policy_line = "autoscale policy: up when more than 4 requests wait per serving instance"
        assert f"{policy_line} for 45s" in shown
        listed = [line for line in dctl("deploy", "list").stdout.splitlines() if "chat" in line]
        assert "1/1/4 +1 standby" in listed[0]
        roles = [line.split()[5] for line in shown.split("\n\n")[1].splitlines()[1:]]
        assert sorted(roles) == ["serving", "standby"]  # one serving and its standby, placed
        said = dctl("deploy", "autoscale", "chat").stdout
        assert said.startswith("deployment chat autoscales 1/1/4 +1 standby (min/current/max")

        # A fine autoscaler: nothing for the doctor's autoscale rule to say.
        doctor = json.loads(dctl("doctor", "chat", "--json").stdout)
        assert [f for f in doctor if f["rule"] == "autoscale.limits"] == []

        off = dctl("deploy", "autoscale", "chat", "--off")
        assert off.code == OK, off.stderr
        assert off.stdout.startswith("deployment chat: autoscaling off; it keeps its ")
        assert json.loads(dctl("deploy", "show", "chat", "--json").stdout)["autoscale"] is None
        assert re.search(r"^autoscale:\s+-$", dctl("deploy", "show", "chat").stdout, re.MULTILINE)
    finally:
        dctl("deploy", "delete", "chat", "--yes")
        dctl("host", "remove", "as-1", "--yes")
