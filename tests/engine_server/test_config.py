"""The server's configuration: YAML plus flags, refused at start-up with one line naming the key."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from protocol.engine_config import FLAGS, ServeConfig, ServeConfigError, load_serve_config
from tests.engine_server.conftest import MODEL, ROOT, ServerProcess, free_port, wait_ready


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_issue_example_loads(tmp_path: Path, demo_checkpoint: Path) -> None:
    path = write(
        tmp_path,
        {
            "service": {"host": "127.0.0.1", "port": 8080, "max_concurrent_requests": 32,
                        "max_queue": 256, "request_timeout_s": 120, "api_key": None},
            "model": {"path": str(demo_checkpoint), "served_name": "demo", "dtype": "bf16",
                      "max_seq_len": 4096, "block_size": 32, "threshold": 0.9, "min_steps": 1,
                      "max_steps": 32, "thinking": False},
            "resources": {"device": "auto", "memory_fraction": 0.85, "threads": None},
            "logging": {"level": "info", "format": "json"},
        },
    )  # fmt: skip
    config = load_serve_config(path)
    assert config.model.name == "demo"
    assert config.model.block_size == 32
    assert config.service.api_key is None


def test_every_key_has_a_flag() -> None:
    keys = {
        f"{section}.{key}"
        for section, field in ServeConfig.model_fields.items()
        for key in field.annotation.model_fields  # type: ignore[union-attr]
    }
    assert set(FLAGS.values()) == keys


def test_flags_override_the_file(tmp_path: Path, demo_checkpoint: Path) -> None:
    path = write(tmp_path, {"model": {"path": str(demo_checkpoint)}, "service": {"port": 1234}})
    config = load_serve_config(
        path,
        {"service.port": "9000", "model.thinking": "true", "model.max_steps": "null",
         "service.api_key": "12345"},
    )  # fmt: skip
    assert config.service.port == 9000
    assert config.model.thinking is True
    assert config.model.max_steps is None
    assert config.service.api_key == "12345"  # text stays text
    assert config.model.name == demo_checkpoint.name


@pytest.mark.parametrize(
    ("model", "extra", "needle"),
    [
        ({}, {"service": {"prot": 1}}, "unknown key 'service.prot'"),
        ({}, {"servce": {}}, "unknown key 'servce'"),
        ({"threshold": 1.5}, {}, "model.threshold"),
        ({"dtype": "int4"}, {}, "model.dtype"),
        ({}, {"service": {"port": 70000}}, "service.port"),
        ({}, {"resources": {"device": "tpu"}}, "resources.device"),
        ({}, {"logging": {"level": "loud"}}, "logging.level"),
        ({}, {"service": {"max_concurrent_requests": 0}}, "service.max_concurrent_requests"),
        ({"path": "/nonexistent/ckpt"}, {}, "model.path"),
        ({"steps": 0}, {}, "model.steps"),
        ({"block_size": 4, "steps": 8}, {}, "model.steps (8) must be <= model.block_size (4)"),
    ],
)
def test_bad_configs_fail_with_one_line_naming_the_key(
    tmp_path: Path, demo_checkpoint: Path, model: dict, extra: dict, needle: str
) -> None:
    data = {"model": {"path": str(demo_checkpoint), **model}, **extra}
    with pytest.raises(ServeConfigError) as info:
        load_serve_config(write(tmp_path, data))
    message = str(info.value)
    assert needle in message
    assert "\n" not in message


def test_missing_model_path_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ServeConfigError, match=r"model.path is required"):
        load_serve_config(write(tmp_path, {"service": {"port": 8080}}))
    bad = tmp_path / "bad.yaml"
    bad.write_text("service: [unclosed\n")
    with pytest.raises(ServeConfigError, match="not valid YAML"):
        load_serve_config(bad)
    with pytest.raises(ServeConfigError, match="cannot read"):
        load_serve_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, "-m", "engine.serve"],
        [sys.executable, "-m", "cli", "engine", "serve"],
    ],
)
def test_the_commands_exit_2_with_one_line(
    tmp_path: Path, demo_checkpoint: Path, command: list[str]
) -> None:
    path = write(tmp_path, {"model": {"path": str(demo_checkpoint), "threshold": 0}})
    result = subprocess.run(
        [*command, "--config", str(path), "--port", "8089"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.threshold" in lines[0]


def test_a_checkpoint_that_fails_to_load_ends_the_process_with_1(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(demo_checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated download
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "engine.serve", "--model", str(broken), "--port", str(port),
         "--device", "cpu", "--log-format", "json"],
        capture_output=True, text=True, cwd=ROOT, timeout=180,
    )  # fmt: skip
    assert result.returncode == 1
    records = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    failure = next(r for r in records if r["msg"] == "model load failed")
    assert "CheckpointError" in failure["error"] and "model.safetensors" in failure["error"]


def test_python_m_engine_serve_runs_standalone_from_a_config_file(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    """How the agent runs an engine: `python -m engine.serve --config FILE`, from a directory
    of its own (not the repository), serving until SIGTERM, then exit 0. The API key in the
    file never reaches the log."""
    key = "sk-standalone-5d1e0b"
    port = free_port()
    config = write(
        tmp_path,
        {
            "service": {"host": "127.0.0.1", "port": port, "api_key": key},
            "model": {"path": str(demo_checkpoint), "served_name": MODEL, "dtype": "fp32",
                      "max_seq_len": 256},
            "resources": {"device": "cpu", "threads": 1},
            "logging": {"level": "info", "format": "kv"},
        },
    )  # fmt: skip
    log_path = tmp_path / "engine.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.serve", "--config", str(config)],
            cwd=tmp_path,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_ready(server)
        response = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
            headers={"authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
    finally:
        assert server.stop() == 0
    log = log_path.read_text()
    assert "msg=starting" in log and "msg=drained" in log
    assert key not in log
