"""The JSONL request log: one line per request in `RequestSummary`'s JSON, written off the
request path, rotated by size, lines dropped (and counted) rather than requests slowed; and,
through a live gateway, the line of each request: its id (the one the client and the engine
saw), token name (never the secret), version, instance, usage, diffusion figures and TTFT."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gateway import GatewaySettings, SettingsError, build_gateway, load_gateway_settings
from gateway.request_log import RequestLog
from protocol.logs import RequestSummary
from tests.clock import START
from tests.gateway.canned_engine import COMPLETION_TOKENS, FIGURES, PROMPT_TOKENS
from tests.gateway.conftest import ENGINES, Fleet, LiveGateway, served

# RFC 3339 in UTC, as Loki, Vector and Fluent Bit parse it with no custom parser.
RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


class Count:
    """Stands in for a Prometheus counter child."""

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


def summary(n: int, status: int = 200) -> RequestSummary:
    return RequestSummary(
        request_id=f"req-{n:05d}", time=START + timedelta(seconds=n), token="app",
        deployment="chat", version="m:v1", pool="stable", instance_id=3, status=status,
        prompt_tokens=5, completion_tokens=9, steps_per_block=2.5, tokens_per_forward=1.5,
        ttft_s=0.02, latency_s=0.25, stream=True,
    )  # fmt: skip


def opened(path: Path, **options: Any) -> tuple[RequestLog, Count, Count]:
    written, dropped = Count(), Count()
    options = {"max_bytes": 2**20, "max_files": 3, **options}
    log = RequestLog(path, written=written, dropped=dropped, flush_s=0.01, **options)
    log.start()
    return log, written, dropped


def test_one_line_per_request_in_the_models_json(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "requests.jsonl"  # its folder is made
    log, written, dropped = opened(path)
    for n in range(3):
        log.write(summary(n))
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == ["req-00000", "req-00001", "req-00002"]
    assert set(lines[0]) == set(RequestSummary.model_fields)
    assert RFC3339_UTC.match(lines[1]["time"]), lines[1]["time"]
    assert datetime.fromisoformat(lines[1]["time"]) == START + timedelta(seconds=1)
    assert RequestSummary.model_validate(lines[2]) == summary(2)
    assert (written.value, dropped.value) == (3, 0)
    assert path.stat().st_mode & 0o777 == 0o640


def test_the_file_rotates_by_size_and_keeps_max_files(tmp_path: Path) -> None:
    path = tmp_path / "requests.jsonl"
    log, written, _ = opened(path, max_bytes=4096, max_files=3)
    for n in range(200):
        log.write(summary(n))
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["requests.jsonl", "requests.jsonl.1", "requests.jsonl.2"]
    kept = []
    for name in reversed(names):  # oldest first
        text = (tmp_path / name).read_text()
        assert 0 < len(text) <= 4096 and text.endswith("\n")
        kept += [json.loads(line)["request_id"] for line in text.splitlines()]
    # The newest lines, in order, none cut in two.
    assert kept == [f"req-{n:05d}" for n in range(200 - len(kept), 200)]
    assert written.value == 200
    # Opened again, the log appends to the file it finds.
    again, _, _ = opened(path, max_bytes=4096, max_files=3)
    again.write(summary(999))
    again.close()
    assert path.read_text().splitlines()[-1].startswith('{"request_id":"req-00999"')


def test_a_full_queue_drops_lines_and_counts_them_instead_of_blocking(tmp_path: Path) -> None:
    log, written, dropped = opened(tmp_path / "r.jsonl", queue_lines=10)
    started = time.perf_counter()
    for n in range(5000):
        log.write(summary(n))
    assert time.perf_counter() - started < 1.0
    log.close()
    assert dropped.value > 0
    assert written.value + dropped.value == 5000
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == written.value


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_disk_that_fails_drops_lines_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    log, written, dropped = opened(Path("/dev/full"))
    log.write(summary(1))
    time.sleep(0.1)
    log.write(summary(2))
    log.close()
    assert (written.value, dropped.value) == (0, 2)
    assert sum("cannot write the request log" in r.message for r in caplog.records) == 1


def test_the_request_log_is_off_unless_a_file_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCTL_CONFIG", str(tmp_path / "absent.toml"))
    routes = tmp_path / "routes.json"
    routes.write_text('{"etag": "e"}')
    defaults = load_gateway_settings(None, routes_file=routes)
    assert defaults.request_log_file is None
    assert (defaults.request_log_max_bytes, defaults.request_log_max_files) == (100 * 2**20, 5)
    assert defaults.summary_sample_rps == 20.0
    assert build_gateway(defaults).request_log is None
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DCTL_GATEWAY_REQUEST_LOG_FILE", "logs/requests.jsonl")
    named = load_gateway_settings(None, routes_file=routes)
    assert named.request_log_file == tmp_path / "logs" / "requests.jsonl"  # made absolute
    with pytest.raises(SettingsError, match=r"request_log_max_files .*DCTL_GATEWAY_REQUEST_LOG"):
        load_gateway_settings(None, routes_file=routes, request_log_max_files=0)


def test_a_request_log_that_cannot_be_written_is_a_settings_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    settings = GatewaySettings(
        routes_file=tmp_path / "routes.json", request_log_file=tmp_path / "file" / "r.jsonl"
    )
    with pytest.raises(SettingsError, match="request_log_file"):
        build_gateway(settings)


# --- through a live gateway ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def logged(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    """A gateway writing a request log."""
    path = tmp_path_factory.mktemp("request-log") / "requests.jsonl"
    settings = GatewaySettings(
        routes_file=fleet.routes_file, port=0, rate_limit_rps=0, request_log_file=path
    )
    with served(settings, fleet) as live:
        yield live


def line_of(live: LiveGateway, request_id: str) -> dict[str, Any]:
    """The request log's line for REQUEST_ID (written within moments of the answer)."""
    request_log = live.gateway.request_log
    assert request_log is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in request_log.path.read_text().splitlines():
            found = json.loads(line)
            if found["request_id"] == request_id:
                return dict(found)
        time.sleep(0.02)
    raise AssertionError(f"no line for {request_id}")


def test_the_request_id_goes_to_the_engine_back_to_the_client_and_into_the_line(
    logged: LiveGateway,
) -> None:
    engine = logged.fleet.engines["d"]
    answer = logged.post("solo-model", headers={"x-request-id": "client-id.42"})
    assert answer.status_code == 200
    assert answer.headers["x-request-id"] == "client-id.42"
    assert engine.seen("client-id.42")
    line = line_of(logged, "client-id.42")
    assert line["token"] == "full" and line["status"] == 200
    # No usable id from the client: one made up, the same everywhere.
    fresh = logged.post("solo-model", headers={"x-request-id": "no spaces, please"})
    made = fresh.headers["x-request-id"]
    assert made != "no spaces, please" and engine.seen(made)
    assert line_of(logged, made)["status"] == 200


def test_a_line_says_who_what_where_and_how_the_request_was_decoded(logged: LiveGateway) -> None:
    answer = logged.post("solo-model", headers={"x-request-id": "whole-1"})
    assert answer.status_code == 200
    line = line_of(logged, "whole-1")
    assert {k: line[k] for k in ("token", "deployment", "version", "pool", "instance_id")} == {
        "token": "full", "deployment": "solo", "version": "solo-model:v1", "pool": "stable",
        "instance_id": ENGINES["d"][0],
    }  # fmt: skip
    assert (line["prompt_tokens"], line["completion_tokens"]) == (PROMPT_TOKENS, COMPLETION_TOKENS)
    assert (line["steps_per_block"], line["tokens_per_forward"]) == (
        FIGURES["steps_per_block"], FIGURES["tokens_per_forward"],
    )  # fmt: skip
    assert line["stream"] is False
    assert 0 < line["ttft_s"] <= line["latency_s"] < 5
    assert RFC3339_UTC.match(line["time"])
    # The client's secret and the instance's API key appear nowhere in the log.
    text = logged.gateway.request_log.path.read_text()  # type: ignore[union-attr]
    secret = logged.fleet.tokens["full"]
    assert secret not in text and secret.split("_", 2)[2] not in text
    assert "key-of-d" not in text


def test_a_streams_ttft_is_to_its_first_token_not_its_opening_chunk(logged: LiveGateway) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with logged.http.stream(
        "POST", "/v1/chat/completions",
        headers={"authorization": f"Bearer {logged.fleet.tokens['full']}",
                 "x-request-id": "stream-1"},
        json={"model": "solo-model", "messages": messages, "stream": True, "first_delay": 0.3},
    ) as answer:  # fmt: skip
        body = b"".join(answer.iter_bytes())
    assert answer.status_code == 200 and b": usage" not in body
    line = line_of(logged, "stream-1")
    assert line["stream"] is True
    assert 0.3 <= line["ttft_s"] <= line["latency_s"]
    assert line["completion_tokens"] == COMPLETION_TOKENS
    assert line["steps_per_block"] == FIGURES["steps_per_block"]


def test_refusals_have_their_line_too(logged: LiveGateway) -> None:
    missing = logged.post("solo-model", token=None, headers={"x-request-id": "refused-1"})
    assert missing.status_code == 401
    line = line_of(logged, "refused-1")
    assert (line["status"], line["token"], line["deployment"]) == (401, "", "")
    assert line["instance_id"] is None and line["completion_tokens"] is None
    scoped = logged.post("main-model", token="scoped", headers={"x-request-id": "refused-2"})
    assert scoped.status_code == 403
    line = line_of(logged, "refused-2")
    assert (line["status"], line["token"], line["deployment"]) == (403, "scoped", "main")
    metrics = logged.metrics()
    assert metrics["dctl_gateway_request_log_lines_total{outcome=written}"] >= 2
    assert metrics["dctl_gateway_request_log_lines_total{outcome=dropped}"] == 0
