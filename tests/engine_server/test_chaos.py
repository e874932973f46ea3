"""The engine config's `chaos` section: a canary that is really worse, for game days and tests."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.chaos import Chaos
from protocol.engine_config import (
    ChaosConfig,
    ServeConfigError,
    load_serve_config,
    validate_deployment_config,
)
from protocol.openai import OpenAIErrorReply
from tests.engine_server.conftest import MODEL, ServerProcess, start_server

BODY = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}


@pytest.fixture(scope="module")
def failing(
    tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path
) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("chaos"),
        demo_checkpoint,
        sections={"chaos": {"error_rate": 1.0, "extra_latency_ms": 2500}},
    )
    yield proc
    proc.stop()


def test_every_generation_request_fails_after_the_delay_and_probes_do_not(
    failing: ServerProcess,
) -> None:
    chat = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    for path, body in (("/v1/completions", BODY), ("/v1/chat/completions", chat)):
        start = time.monotonic()
        response = httpx.post(failing.url + path, json=body, timeout=30)
        assert time.monotonic() - start >= 2.5
        assert response.status_code == 500
        error = response.json()["error"]
        assert error["code"] == "chaos_injected" and "chaos.error_rate=1.0" in error["message"]
    start = time.monotonic()
    assert httpx.get(failing.url + "/health/ready", timeout=5).status_code == 200
    assert httpx.get(failing.url + "/v1/models", timeout=5).status_code == 200
    # Not delayed: both probes together take less than the 2.5 s each generation request waits.
    assert time.monotonic() - start < 2.5
    assert failing.metrics()["dllm_request_errors_total{reason=chaos_injected}"] == 2
    warnings = [r for r in failing.log_records() if r.get("level") == "warning"]
    assert any("chaos is on" in r["msg"] for r in warnings)


def test_the_error_rate_is_the_share_of_failures() -> None:
    chaos = Chaos(ChaosConfig(error_rate=0.3), random.Random(7))

    async def outcomes() -> list[bool]:
        failed = []
        for _ in range(1000):
            try:
                await chaos.strike()
                failed.append(False)
            except OpenAIErrorReply as exc:
                assert exc.status == 500
                failed.append(True)
        return failed

    share = sum(asyncio.run(outcomes())) / 1000
    assert 0.25 <= share <= 0.35
    assert not ChaosConfig().active and ChaosConfig(extra_latency_ms=1).active


def test_bad_chaos_values_name_the_key_and_deployments_may_set_it(demo_checkpoint: Path) -> None:
    with pytest.raises(ServeConfigError, match=r"chaos\.error_rate"):
        load_serve_config(None, {"model.path": str(demo_checkpoint), "chaos.error_rate": "1.5"})
    with pytest.raises(ServeConfigError, match=r"chaos\.extra_latency_ms"):
        load_serve_config(
            None, {"model.path": str(demo_checkpoint), "chaos.extra_latency_ms": "-1"}
        )
    assert validate_deployment_config({"chaos": {"error_rate": 0.5}}) == {
        "chaos": {"error_rate": 0.5}
    }
