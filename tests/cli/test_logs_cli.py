"""`dctl logs`, `dctl requests` and `dctl audit`: the flags read into the query sent, what an
operator reads back (prefixes, time order, control characters removed, CSV, the audit's
anomalies), and `--follow`: resumed after a drop with the last cursor, given up with a clean
message when it cannot be, Ctrl-C exiting 0.

The commands talk to a loopback server with canned answers and canned Server-Sent Events
(`tests.cli.canned_api`), built from the API models; `tests/cli/test_logs_e2e.py` runs them
against `dctl server`."""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import typer

from cli.cmd_logs import PAGE_LINES, follow_lines
from cli.exits import FAILURE, OK, USAGE
from cli.log_stream import FollowFailed, LogStream, SseEvent, follow, sse_events
from client.credentials import Context
from protocol.logs import AuditReport, LogEntry, LogPage, RequestOut, TokenAudit
from tests.cli.canned_api import CannedApi, Stream, sse_line
from tests.cli.conftest import DCTL, Dctl, isolated_env

LOGS = "/api/v1/deployments/web/logs"
FOLLOW = f"{LOGS}/follow"
REQUESTS = "/api/v1/deployments/web/requests"
AUDIT = "/api/v1/audit"
T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def entry(
    id: int, line: str, *, host: str = "gpu-1", instance: int | None = 12, seconds: float = 0
) -> dict[str, Any]:
    source = "engine" if instance is not None else "agent"
    return LogEntry(
        id=id, time=T0 + timedelta(seconds=seconds), host=host, source=source,
        deployment="web", instance_id=instance, line=line,
    ).model_dump(mode="json")  # fmt: skip


def page(*items: dict[str, Any], cursor: int, dropped: int = 0) -> dict[str, Any]:
    return LogPage.model_validate(
        {"items": list(items), "next_cursor": cursor, "dropped": dropped}
    ).model_dump(mode="json")


def summary(request_id: str = "r-1", **fields: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "request_id": request_id, "time": T0, "token": "alice", "deployment": "web",
        "version": "sdar-moe:v2", "pool": "canary", "instance_id": 12, "status": 200,
        "prompt_tokens": 31, "completion_tokens": 256, "steps_per_block": 4.5,
        "tokens_per_forward": 3.56, "ttft_s": 0.042, "latency_s": 1.5, "gateway": "gw-1",
    }  # fmt: skip
    values.update(fields)
    return RequestOut.model_validate(values).model_dump(mode="json")


def since_of(query: dict[str, list[str]]) -> datetime:
    return datetime.fromisoformat(query["since"][0].replace("Z", "+00:00"))


# --- dctl logs ------------------------------------------------------------------------------------


def test_the_flags_are_the_query_sent(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", LOGS, (200, page(cursor=7)))
    result = run("logs", "web", "--instance", "12", "--host", "gpu-1", "--since", "10m",
                 "--grep", "out of memory", "--agent")  # fmt: skip
    assert result.code == OK, result.stderr
    [query] = canned.queries(LOGS)
    assert {k: v for k, v in query.items() if k != "since"} == {
        "instance": ["12"], "host": ["gpu-1"], "grep": ["out of memory"], "agent": ["true"],
        "limit": [str(PAGE_LINES)],
    }  # fmt: skip
    assert abs(since_of(query) - (datetime.now(UTC) - timedelta(minutes=10))) < timedelta(
        seconds=30
    )
    # Without --since the control plane's default (the last hour) holds: nothing is sent.
    assert run("logs", "web").code == OK
    assert "since" not in canned.queries(LOGS)[-1]


def test_a_bad_since_is_a_usage_error_before_any_request(run: Dctl, canned: CannedApi) -> None:
    result = run("logs", "web", "--since", "ten minutes")
    assert result.code == USAGE
    assert "--since 'ten minutes'" in result.stderr
    assert canned.requests == []


def test_pages_through_with_the_cursor_and_prints_lines_in_time_order_with_their_origin(
    run: Dctl, canned: CannedApi
) -> None:
    # A full page means more may follow: the next request continues after its cursor.
    full = [entry(i, f"step {i}", seconds=i) for i in range(1, PAGE_LINES + 1)]
    last = page(
        # Shipped by two hosts' agents at different times: stored out of time order.
        entry(PAGE_LINES + 2, "loading experts", host="gpu-2", instance=13, seconds=5000),
        entry(PAGE_LINES + 1, "heartbeat sent", host="gpu-1", instance=None, seconds=4000),
        cursor=PAGE_LINES + 2,
        dropped=3,
    )
    canned.on("GET", LOGS, (200, page(*full, cursor=PAGE_LINES)), (200, last))
    result = run("logs", "web", "--agent")
    assert result.code == OK, result.stderr
    assert [q.get("after") for q in canned.queries(LOGS)] == [None, [str(PAGE_LINES)]]
    lines = result.stdout.splitlines()
    assert lines[0] == "gpu-1 i12 | step 1"
    assert lines[PAGE_LINES - 1] == f"gpu-1 i12 | step {PAGE_LINES}"
    assert lines[PAGE_LINES:] == ["gpu-1 agent | heartbeat sent", "gpu-2 i13 | loading experts"]
    assert "the agents dropped 3 line(s)" in result.stderr


def test_control_characters_never_reach_the_terminal(run: Dctl, canned: CannedApi) -> None:
    hostile = "\x1b]0;owned\x07title \x1b[31mred\x1b[0m\x9b2J done\r\nnext"
    canned.on("GET", LOGS, (200, page(entry(1, hostile), cursor=1)))
    result = run("logs", "web")
    assert result.stdout == "gpu-1 i12 | title red done  next\n"
    # JSON lines escape them: the text is kept whole for scripts, inert on a terminal.
    as_json = run("logs", "web", "--json")
    assert as_json.code == OK
    [line] = as_json.stdout.splitlines()
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in line)
    assert LogEntry.model_validate_json(line).line == hostile


def test_request_prints_the_gateways_summary_above_its_lines(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", REQUESTS, (200, [summary("r-7", status=504, latency_s=30.0)]))
    canned.on("GET", LOGS, (200, page(entry(4, "r-7 block 3 timed out"), cursor=4)))
    result = run("logs", "web", "--request", "r-7")
    assert result.code == OK, result.stderr
    assert canned.queries(REQUESTS) == [{"request": ["r-7"]}]
    assert canned.queries(LOGS)[0]["request"] == ["r-7"]
    head, _, lines = result.stdout.partition("\n\n")
    assert "request:           r-7" in head and "status:            504" in head
    assert "version/pool:      sdar-moe:v2/canary" in head and "latency:           30.00 s" in head
    assert lines == "gpu-1 i12 | r-7 block 3 timed out\n"
    # A request no gateway reported (sampled out): a note, and the lines all the same.
    canned.on("GET", REQUESTS, (200, []))
    again = run("logs", "web", "--request", "r-7")
    assert again.stdout == "gpu-1 i12 | r-7 block 3 timed out\n"
    assert "no gateway summary of request 'r-7'" in again.stderr


def test_an_unknown_deployment_is_one_line(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", LOGS, (404, {"code": "not_found", "message": "no deployment 'web'"}))
    result = run("logs", "web")
    assert result.code == FAILURE
    assert result.stderr == "error: no deployment 'web' (HTTP 404)\n"


# --- following ------------------------------------------------------------------------------------


def test_sse_events_are_read_by_the_formats_rules() -> None:
    text = ': keep-alive\n\nevent: line\ndata: {"a":\ndata: 1}\nid: 9\n\ndata:x\n\n'
    assert list(sse_events(text.split("\n"))) == [
        None,
        SseEvent("line", '{"a":\n1}', "9"),
        SseEvent("message", "x", "9"),
    ]


def context(api: CannedApi) -> Context:
    return Context(name="test", url=api.url, token="t")


def test_a_dropped_stream_is_resumed_after_the_last_line_shown(canned: CannedApi) -> None:
    canned.stream(
        FOLLOW,
        # Ends after two lines, as a bounded stream does: the next one is opened at once.
        Stream([sse_line(entry(11, "a")), ": keep-alive\n\n", sse_line(entry(12, "b"))]),
        Stream(status=503),  # the control plane restarting: wait, then try again
        Stream([": keep-alive\n\n", sse_line(entry(13, "c"))]),
        Stream(),  # accepted, then nothing: it ends at once, every time
    )
    shown: list[int] = []
    waits: list[float] = []
    stream = LogStream(context(canned), FOLLOW, {"grep": "x"})
    with pytest.raises(FollowFailed) as failed:
        follow(stream, 10, lambda e: shown.append(e.id), sleep=waits.append, delays=(1, 2, 4))
    assert shown == [11, 12, 13]
    # Each connection starts after the last line shown, with the filters.
    queries = canned.queries(FOLLOW)
    assert [q["after"] for q in queries] == [["10"], ["12"], ["12"], ["13"], ["13"], ["13"], ["13"]]
    assert all(q["grep"] == ["x"] for q in queries)
    # A connection that brought something back starts the count of attempts again.
    assert waits == [1, 1, 2, 4]
    assert (failed.value.after, failed.value.attempts) == (13, 3)
    assert failed.value.reason == "the control plane ended the stream"


def test_a_stream_that_cannot_be_resumed_exits_1_naming_the_cursor(
    canned: CannedApi, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DCTL_URL", canned.url)
    monkeypatch.setenv("DCTL_TOKEN", "t")
    canned.stream(FOLLOW, Stream([sse_line(entry(21, "last words"))]), Stream(status=502))
    with pytest.raises(typer.Exit) as exited:
        follow_lines("web", {"agent": False}, 20, as_json=False, delays=(0, 0))
    assert exited.value.exit_code == FAILURE
    out, err = capsys.readouterr()
    assert out == "gpu-1 i12 | last words\n"
    assert err.startswith("error: the log stream of web dropped and 2 reconnect(s) failed (")
    assert "HTTP 502" in err
    assert err.rstrip().endswith("resume after the last line shown: "
                                 "dctl logs web --follow --after 21")  # fmt: skip


def test_a_refused_stream_ends_at_once(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", LOGS, (200, page(cursor=3)))
    refused = json.dumps({"code": "forbidden", "message": "viewer role required"})
    canned.stream(FOLLOW, Stream([refused], status=403))
    started = time.monotonic()
    result = run("logs", "web", "--follow")
    assert result.code == FAILURE
    assert result.stderr == ("error: following the logs of web: viewer role required (HTTP 403)\n")
    assert time.monotonic() - started < 5  # no reconnecting
    assert len(canned.queries(FOLLOW)) == 1


def test_follow_prints_history_then_new_lines_and_ctrl_c_exits_0(
    tmp_path: Path, canned: CannedApi
) -> None:
    canned.on("GET", LOGS, (200, page(entry(5, "old line"), cursor=5)))
    canned.stream(FOLLOW, Stream([sse_line(entry(6, "new line", host="gpu-2"))], hold=True))
    env = {**isolated_env(tmp_path), "DCTL_URL": canned.url, "DCTL_TOKEN": "t"}
    proc = subprocess.Popen(
        [*DCTL, "logs", "web", "--follow"], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "gpu-1 i12 | old line\n"
        assert proc.stdout.readline() == "gpu-2 i12 | new line\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == OK, err
    assert err == "" and out == ""
    assert [q["after"] for q in canned.queries(FOLLOW)] == [["5"]]


# --- dctl requests --------------------------------------------------------------------------------


def test_requests_flags_are_the_query_sent(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", REQUESTS, (200, []))
    result = run("requests", "web", "--since", "2h", "--slowest", "20", "--errors")
    assert result.code == OK, result.stderr
    assert result.stdout == "(no requests in the last 2h)\n"
    [query] = canned.queries(REQUESTS)
    assert (query["slowest"], query["errors"]) == (["20"], ["true"])
    assert abs(since_of(query) - (datetime.now(UTC) - timedelta(hours=2))) < timedelta(seconds=30)
    # The default range is the last hour.
    assert run("requests", "web").code == OK
    query = canned.queries(REQUESTS)[-1]
    assert set(query) == {"since"}
    assert abs(since_of(query) - (datetime.now(UTC) - timedelta(hours=1))) < timedelta(seconds=30)


def test_requests_table_shows_what_served_each_and_how_long_it_took(
    run: Dctl, canned: CannedApi
) -> None:
    failed = summary("r-2", status=502, prompt_tokens=None, completion_tokens=None,
                     steps_per_block=None, tokens_per_forward=None, ttft_s=None, latency_s=0.3,
                     token="bob\x1b[2J", pool="")  # fmt: skip
    canned.on("GET", REQUESTS, (200, [summary(), failed]))
    result = run("requests", "web")
    assert result.code == OK, result.stderr
    header, first, second = result.stdout.splitlines()
    assert header.split() == ["TIME", "REQUEST", "TOKEN", "VERSION/POOL", "STATUS",
                              "PROMPT/COMPLETION", "STEPS/BLOCK", "TOK/FORWARD", "TTFT",
                              "LATENCY"]  # fmt: skip
    assert first.split() == ["2026-01-01", "12:00:00", "r-1", "alice", "sdar-moe:v2/canary",
                             "200", "31/256", "4.5", "3.56", "42", "ms", "1.50", "s"]  # fmt: skip
    assert second.split() == ["2026-01-01", "12:00:00", "r-2", "bob", "sdar-moe:v2", "502",
                              "-", "-", "-", "-", "300", "ms"]  # fmt: skip


def test_requests_as_csv_has_a_header_row_of_the_fields(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", REQUESTS, (200, [summary(token="eve\x07")]))
    result = run("requests", "web", "--csv")
    assert result.code == OK, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert list(rows[0]) == list(RequestOut.model_fields)
    assert rows[0]["request_id"] == "r-1" and rows[0]["latency_s"] == "1.5"
    assert rows[0]["token"] == "eve" and rows[0]["stream"] == "false"
    as_json = run("requests", "web", "--json")
    assert json.loads(as_json.stdout)[0]["request_id"] == "r-1"
    both = run("requests", "web", "--json", "--csv")
    assert both.code == USAGE and "choose one" in both.stderr


# --- dctl audit -----------------------------------------------------------------------------------


def audit_report() -> dict[str, Any]:
    tokens = [
        TokenAudit(
            token="alice", requests=1200, errors=36, rate_limited=4, error_share=0.03,
            deployments=["web", "chat"], first_seen=T0 - timedelta(days=6), last_seen=T0,
            anomalies=["request rate jumped: 1000 in the last day against 40 a day before"],
        ),
        TokenAudit(
            token="ci", requests=0, errors=0, rate_limited=0, error_share=0.0, deployments=[],
            first_seen=None, last_seen=T0, refused={"revoked": 17},
            anomalies=["revoked, still tried: refused 17 time(s)"],
        ),
        TokenAudit(
            token="bob", requests=10, errors=0, rate_limited=0, error_share=0.0,
            deployments=["web"], first_seen=T0, last_seen=T0,
        ),
    ]  # fmt: skip
    report = AuditReport(since=T0 - timedelta(days=7), until=T0, tokens=tokens)
    return report.model_dump(mode="json")


def test_audit_prints_a_row_per_token_and_the_anomalies_under_the_table(
    run: Dctl, canned: CannedApi
) -> None:
    canned.on("GET", AUDIT, (200, audit_report()))
    result = run("audit", "--since", "3d")
    assert result.code == OK, result.stderr
    [query] = canned.queries(AUDIT)
    assert abs(since_of(query) - (datetime.now(UTC) - timedelta(days=3))) < timedelta(seconds=30)
    lines = result.stdout.splitlines()
    assert lines[0] == "client tokens from 2025-12-25 12:00 to 2026-01-01 12:00 UTC"
    assert lines[1].split()[:4] == ["TOKEN", "REQUESTS", "ERRORS", "429S"]
    alice = next(line for line in lines if line.startswith("alice"))
    assert "1200" in alice and "3.0%" in alice and "web, chat" in alice
    ci = next(line for line in lines if line.startswith("ci"))
    assert "revoked=17" in ci
    anomalies = result.stdout.split("\nanomalies:\n")[1]
    assert anomalies == (
        "  alice: request rate jumped: 1000 in the last day against 40 a day before\n"
        "  ci: revoked, still tried: refused 17 time(s)\n"
    )
    as_json = run("audit", "--json")
    assert AuditReport.model_validate(json.loads(as_json.stdout)).tokens[1].token == "ci"


def test_audit_needs_an_admin(run: Dctl, canned: CannedApi) -> None:
    canned.on("GET", AUDIT, (403, {"code": "forbidden", "message": "admin role required"}))
    result = run("audit")
    assert result.code == FAILURE
    assert result.stderr.startswith("error: the access audit needs an admin token (admin role")
