"""The engine logs through the project's redacting formatters (runtime.logs): its API key never
reaches a log line, not even in the configuration logged at start-up."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engine.serve import log_start
from protocol.engine_config import load_serve_config
from runtime.logs import configure_logging
from tests.engine_server.conftest import MODEL

KEY = "sk-engine-3c9d2f"  # not shaped like a dctl token: only the field name gives it away


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("fmt", ["json", "kv"])
def test_the_start_up_line_logs_the_config_without_the_api_key(
    fmt: str, tmp_path: Path, demo_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(
        yaml.safe_dump(
            {"model": {"path": str(demo_checkpoint)}, "service": {"api_key": KEY},
             "logging": {"format": fmt}}
        )
    )  # fmt: skip
    config = load_serve_config(path)
    configure_logging(config.logging.level, config.logging.format)
    log_start(config)
    logging.getLogger("engine.server").warning("refused: Authorization: Bearer %s", KEY)
    err = capsys.readouterr().err
    assert KEY not in err
    assert str(demo_checkpoint) in err  # the configuration is there, all but the key
    if fmt == "json":
        start = json.loads(err.splitlines()[0])
        assert start["msg"] == "starting"
        assert start["config"]["service"]["api_key"] == "***"


def test_a_request_id_from_the_gateway_is_echoed_and_logged(server: Any) -> None:
    """The gateway passes `x-request-id`; the engine answers with it and logs it, so one id
    finds a request in both logs. A hostile id (spaces, 400 bytes) is replaced by a fresh one."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    sent = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"x-request-id": "gw-abc.123"}
    )
    assert sent.status_code == 200, sent.text
    assert sent.headers["x-request-id"] == "gw-abc.123"
    hostile = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"x-request-id": "a b;" * 100}
    )
    fresh = hostile.headers["x-request-id"]
    assert len(fresh) == 32 and fresh.isalnum()

    def logged() -> dict[str, dict[str, Any]]:
        lines = [json.loads(line) for line in server.log_path.read_text().splitlines()
                 if line.startswith("{")]  # fmt: skip
        return {line.get("request_id"): line for line in lines if line.get("msg") == "request"}

    # The line is written once the response is sent: it may trail the answer by a moment.
    deadline = time.monotonic() + 10
    while fresh not in logged() and time.monotonic() < deadline:
        time.sleep(0.05)
    found = logged()
    assert found["gw-abc.123"]["status"] == 200
    assert found["gw-abc.123"]["path"] == "/v1/completions"
    assert fresh in found


@pytest.mark.usefixtures("restore_logging")
def test_a_count_named_like_a_secret_stays_readable_and_a_secret_does_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", "json")
    logging.getLogger("engine.serve").info(
        "memory plan",
        extra={"kv_bytes_per_token": 4096, "bootstrap_token": KEY,
               "instance_api_key": {"value": KEY}, "token": None},
    )  # fmt: skip
    err = capsys.readouterr().err
    line = json.loads(err.splitlines()[-1])
    assert line["kv_bytes_per_token"] == 4096 and line["token"] is None
    assert line["bootstrap_token"] == "***" and line["instance_api_key"] == "***"
    assert KEY not in err
