"""Server lifecycle and admission, on two servers started side by side.

`guarded`: an API key and a 1.5 s request timeout (probes during start-up, logs, 401, 504).
`narrow`: one slot and a one-request queue (429 with Retry-After), then the SIGTERM drain
that ends it.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.engine_server.conftest import MODEL, ServerProcess, launch_server, wait_ready

API_KEY = "sk-test-7f3a9c"
AUTH = {"authorization": f"Bearer {API_KEY}"}
# Block 4 in steps mode with steps=4 is one token per forward: 4000 tokens are thousands of
# forwards, far longer than any check below on any machine.
SLOW = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "steps": 4}


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    tmp = tmp_path_factory.mktemp("lifecycle")
    # Launched together so their start-ups overlap.
    guarded = launch_server(
        tmp, demo_checkpoint, {"api_key": API_KEY, "request_timeout_s": 1.5}, max_seq_len=4096
    )
    narrow = launch_server(
        tmp,
        demo_checkpoint,
        {"max_concurrent_requests": 1, "max_queue": 1, "shutdown_grace_s": 60},
        max_seq_len=4096,
    )
    try:
        yield wait_ready(guarded), wait_ready(narrow)
    finally:
        guarded.stop()
        narrow.stop()


@pytest.fixture(scope="module")
def guarded(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def narrow(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[1]


def first_event(lines: Iterator[str]) -> dict[str, Any]:
    """The first SSE event. Keep `lines` referenced: dropping httpx's line iterator closes
    the connection, which the server rightly takes as the client leaving."""
    line = next(line for line in lines if line.startswith("data: "))
    return dict(json.loads(line.removeprefix("data: ")))


def test_readiness_is_503_while_loading_and_liveness_200(guarded: ServerProcess) -> None:
    assert guarded.probes, "the server answered probes before it was ready"
    assert guarded.probes[0] == (200, 503)
    assert guarded.probes[-1] == (200, 200)


def test_startup_logs_weights_memory_plan_and_address(guarded: ServerProcess) -> None:
    records = {r["msg"]: r for r in guarded.log_records()}
    assert records["weights loaded"]["weights_bytes"] > 0
    assert records["weights loaded"]["seconds"] >= 0
    plan = records["memory plan"]
    assert plan["total_bytes"] >= plan["weights_bytes"] + plan["kv_cache_bytes"]
    assert records["listening"]["address"] == guarded.url
    assert API_KEY not in guarded.log_path.read_text()


@pytest.mark.parametrize(
    "headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}]
)
def test_missing_or_wrong_api_key_is_401(guarded: ServerProcess, headers: dict[str, str]) -> None:
    response = httpx.post(
        f"{guarded.url}/v1/completions", json={**SLOW, "max_tokens": 2}, headers=headers
    )
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded.url}/v1/models", headers=headers).status_code == 401


def test_the_right_api_key_is_accepted(guarded: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=API_KEY, max_retries=0)
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert result.usage is not None and result.usage.completion_tokens <= 3
    # Probes and metrics stay open: the agent and Prometheus hold no API key.
    assert httpx.get(f"{guarded.url}/health/ready").status_code == 200
    assert httpx.get(f"{guarded.url}/metrics").status_code == 200


def test_full_queue_is_429_with_retry_after(narrow: ServerProcess) -> None:
    narrow.wait_idle()
    url = f"{narrow.url}/v1/completions"
    body = {**SLOW, "stream": True}
    # One running, one waiting: capacity 2. Both streams stay open until the block exits.
    with (
        httpx.stream("POST", url, json=body, timeout=60) as running,
        httpx.stream("POST", url, json=body, timeout=60) as waiting,
    ):
        assert running.status_code == 200 and waiting.status_code == 200
        lines = running.iter_lines()
        first_event(lines)
        refused = httpx.post(url, json={**SLOW, "max_tokens": 2})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
        m = narrow.metrics()
        assert m["dllm_requests_running"] == 1
        assert m["dllm_request_errors_total{reason=queue_full}"] == 1
    narrow.wait_idle()  # both streams were closed: their requests are aborted


def test_a_request_over_the_timeout_is_504(guarded: ServerProcess) -> None:
    guarded.wait_idle()
    start = time.monotonic()
    response = httpx.post(f"{guarded.url}/v1/completions", json=SLOW, headers=AUTH, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    assert time.monotonic() - start < 10
    guarded.wait_idle()  # the timed-out request was aborted, its slot freed


def test_sigterm_drains_running_requests_then_exits_0(narrow: ServerProcess) -> None:
    narrow.wait_idle()
    url = f"{narrow.url}/v1/completions"
    # 480 forwards: longer than the checks below, well inside the 60 s grace period.
    body = {**SLOW, "max_tokens": 480, "stream": True}
    events: list[str] = []

    def consume(lines: Iterator[str]) -> None:
        events.extend(line for line in lines if line.startswith("data: "))

    with httpx.stream("POST", url, json=body, timeout=60) as running:
        lines = running.iter_lines()
        first = first_event(lines)
        assert first["choices"][0]["finish_reason"] is None
        reader = threading.Thread(target=consume, args=(lines,))
        reader.start()
        narrow.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert narrow.proc.poll() is None, "the server must wait for the running request"
        ready = httpx.get(f"{narrow.url}/health/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(f"{narrow.url}/health/live", timeout=5).status_code == 200
        refused = httpx.post(url, json={**SLOW, "max_tokens": 2}, timeout=5)
        assert refused.status_code == 503
        reader.join(60)
    assert events[-1] == "data: [DONE]"
    finals = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert finals[-1]["choices"][0]["finish_reason"] == "length"
    assert narrow.proc.wait(30) == 0
    assert "drained" in {r["msg"] for r in narrow.log_records()}


def test_the_api_key_never_appears_in_the_logs(guarded: ServerProcess) -> None:
    """After start-up (which logs the configuration), accepted and refused requests, no log
    line holds the key."""
    guarded.wait_idle()
    records = {r["msg"]: r for r in guarded.log_records()}
    config = records["starting"]["config"]
    assert config["service"]["api_key"] == "***"
    assert config["model"]["served_name"] == MODEL
    assert API_KEY not in guarded.log_path.read_text()
