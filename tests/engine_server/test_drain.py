"""SIGTERM while requests are being answered (what a rolling restart does to an engine under
traffic): every request the server took before the signal, streamed or not, gets the grace
period and its whole answer; nothing ends as a 500 from a handler cut off by the shutdown.

The requests are slow on purpose (one token per forward, hundreds of forwards), so the signal
lands while a non-streamed request waits in `collect` for its last token: the case a drain that
counted only quick requests, or only the engine's bookkeeping, got wrong.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine_server.conftest import MODEL, ServerProcess, launch_server, wait_ready

# An engine process generating for tens of seconds per test: out of `make test-fast`.
pytestmark = pytest.mark.slow

# Block 4 in steps mode with steps=4: one token per forward, so TOKENS forwards per request,
# seconds of work on the tiny model: longer than uvicorn's own graceful-shutdown timeout (5 s).
TOKENS = 3800
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": TOKENS, "steps": 4, "block_size": 4}  # fmt: skip
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": TOKENS, "steps": 4,
              "block_size": 4}  # fmt: skip
# Longer than uvicorn's graceful-shutdown timeout too.
DELAY_MS = 6500


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """`plain`, and `delayed`, whose requests wait DELAY_MS before the engine admits them
    (chaos latency: a request the server took, not yet in the engine). Each test ends one."""
    tmp_path = tmp_path_factory.mktemp("drain")
    service = {"max_concurrent_requests": 4, "max_queue": 4, "shutdown_grace_s": 120}
    plain = launch_server(tmp_path, demo_checkpoint, service, max_seq_len=4096)
    delayed = launch_server(
        tmp_path,
        demo_checkpoint,
        service,
        sections={"chaos": {"extra_latency_ms": DELAY_MS}},
        max_seq_len=4096,
    )
    try:
        yield wait_ready(plain), wait_ready(delayed)
    finally:
        plain.stop()
        delayed.stop()


class Call(threading.Thread):
    """One request in a thread; `answer` once it is back."""

    def __init__(self, url: str, body: dict[str, Any], *, stream: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.stream = url, body, stream
        self.answer: httpx.Response | None = None
        self.events: list[str] = []

    def run(self) -> None:
        if not self.stream:
            self.answer = httpx.post(self.url, json=self.body, timeout=300)
            return
        with httpx.stream("POST", self.url, json={**self.body, "stream": True}, timeout=300) as r:
            self.events = [line for line in r.iter_lines() if line.startswith("data: ")]
            self.answer = r


def wait_running(server: ServerProcess, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metrics()["dllm_requests_running"] < count:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.05)


def test_sigterm_mid_collect_answers_every_request_in_full(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    plain, _ = servers
    chat = Call(f"{plain.url}/v1/chat/completions", CHAT)
    text = Call(f"{plain.url}/v1/completions", COMPLETION)
    stream = Call(f"{plain.url}/v1/completions", COMPLETION, stream=True)
    for call in (chat, text, stream):
        call.start()
    wait_running(plain, 3)
    time.sleep(0.5)  # well into generating: the non-streamed ones wait in `collect`
    plain.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    for call in (chat, text, stream):
        call.join(240)
    took = time.monotonic() - signalled

    assert chat.answer is not None and chat.answer.status_code == 200, chat.answer
    reply = chat.answer.json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == TOKENS
    assert text.answer is not None and text.answer.status_code == 200, text.answer
    assert text.answer.json()["usage"]["completion_tokens"] == TOKENS
    assert stream.answer is not None and stream.events[-1] == "data: [DONE]"
    assert '"finish_reason": "length"' in stream.events[-2]
    assert plain.proc.wait(60) == 0
    # The work outlasted uvicorn's own 5 s: the drain, not uvicorn, decided when to stop.
    assert took > 5, f"the requests took {took:.1f} s after the signal: make TOKENS larger"
    drained = [r for r in plain.log_records() if r["msg"] == "drained"]
    assert drained and drained[0]["aborted"] == 0


def test_a_request_taken_before_sigterm_but_not_yet_admitted_is_answered(
    servers: tuple[ServerProcess, ServerProcess],
) -> None:
    _, delayed = servers
    early = Call(f"{delayed.url}/v1/chat/completions", {**CHAT, "max_tokens": 8})
    early.start()
    time.sleep(1)  # taken, waiting out the chaos delay before admission
    delayed.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # One that arrives after the signal is refused at once, the way a gateway retries elsewhere.
    late = httpx.post(f"{delayed.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
    early.join(60)
    assert early.answer is not None and early.answer.status_code == 200, early.answer.text
    assert early.answer.json()["choices"][0]["finish_reason"] in {"stop", "length"}
    assert delayed.proc.wait(60) == 0
