"""`dctl tune --deployment` against a real engine server on loopback, with an API key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.tuning.grid import DecodeSetting
from engine.tuning.remote import HttpRunner, RemoteError
from tests.engine_server.conftest import MODEL, ServerProcess, start_server
from tests.tune.conftest import dctl

API_KEY = "sk-tune-test-7f3a9c1e5b"
GRID = ["--block-sizes", "4", "--thresholds", "0.9", "--steps", "2", "--max-tokens", "8"]


@pytest.fixture(scope="module")
def engine(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny checkpoint served with an API key."""
    server = start_server(tmp_path_factory.mktemp("engine"), checkpoint, {"api_key": API_KEY})
    yield server
    server.stop()


def test_sweep_through_a_deployment_keeps_the_key_secret(
    engine: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = dctl(
        "tune", "--deployment", MODEL, "--base-url", f"{engine.url}/v1", *GRID,
        "--concurrency", "2", "-o", str(out),
        env={"DCTL_API_KEY": API_KEY},
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert API_KEY not in result.stdout and API_KEY not in result.stderr
    for path in out.iterdir():
        assert API_KEY.encode() not in path.read_bytes(), path.name
    data = json.loads((out / "results.json").read_text())
    assert data["mode"] == "http" and data["model"]["name"] == MODEL
    settings = {s["label"]: s for s in data["settings"]}
    assert list(settings) == ["B4 ref", "B4 t=0.9", "B4 steps=2"]
    assert settings["B4 ref"]["agreement"] == 1.0
    for s in settings.values():
        assert s["heldout_accuracy"] is None and s["tokens_per_forward"] is None
        assert s["completion_tokens"] > 0 and s["p50_s"] > 0
    assert "held-out accuracy: not measured through a deployment" in result.stdout
    assert "run again with --apply" in result.stdout
    assert f"dctl rollout {MODEL} --engine-config FILE --canary 10%" in result.stdout


def test_a_wrong_key_fails_clearly_without_echoing_it(
    engine: ServerProcess, tmp_path: Path
) -> None:
    wrong = "sk-wrong-0123456789"
    key_file = tmp_path / "key"
    key_file.write_text(wrong + "\n")
    result = dctl(
        "tune", "--deployment", MODEL, "--base-url", f"{engine.url}/v1", *GRID,
        "--api-key-file", str(key_file), "-o", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.exit_code == 1
    assert "refused the API key (HTTP 401)" in result.stderr
    assert wrong not in result.stdout + result.stderr
    assert not (tmp_path / "out").exists()  # a failed sweep leaves no empty directory behind


def test_requests_pin_the_stable_pool_and_send_every_decoding_knob() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"role": "assistant", "content": "a b c"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            },
        )

    runner = HttpRunner("http://gw/v1/", "prod", "k", ["hi"], transport=httpx.MockTransport(answer))
    batch = runner.run(DecodeSetting(8, threshold=0.8), max_tokens=16, concurrency=1)
    request = seen[0]
    assert str(request.url) == "http://gw/v1/chat/completions"
    assert request.headers["x-dctl-pool"] == "stable"
    assert request.headers["authorization"] == "Bearer k"
    body = json.loads(request.content)
    assert body["model"] == "prod" and body["temperature"] == 0 and body["max_tokens"] == 16
    assert {k: body[k] for k in ("block_size", "threshold", "min_steps", "max_steps")} == {
        "block_size": 8, "threshold": 0.8, "min_steps": 1, "max_steps": 8,
    }  # fmt: skip
    assert "steps" not in body
    assert batch.samples[0].units == ["a", "b", "c"]
    assert batch.samples[0].completion_tokens == 3


def test_an_unreachable_url_names_it() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    runner = HttpRunner("http://gw/v1", "prod", "k", ["hi"], transport=httpx.MockTransport(refuse))
    with pytest.raises(RemoteError, match="cannot reach http://gw/v1"):
        runner.warm_up(DecodeSetting(4, steps=4, reference=True))
