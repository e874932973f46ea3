"""`dctl tune --deployment NAME --apply`: the recommendation becomes a config canary rollout.

A real `dctl server` holds the deployment (two registered hosts, so a canary fits); a real
engine server answers the sweep's requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cli.tune_apply import merged_engine_config
from client.http import ControlPlaneClient
from protocol.rollout_states import RolloutState
from protocol.rollouts import RolloutAction
from tests.cli.conftest import Dctl, Server, start_server
from tests.cli.hosts import register_host
from tests.engine_server.conftest import MODEL, ServerProcess
from tests.engine_server.conftest import start_server as start_engine
from tests.tune.conftest import dctl

API_KEY = "sk-tune-apply-4b1d8e"
GRID = ["--block-sizes", "4", "--thresholds", "0.9", "--max-tokens", "8", "--no-plot"]
BEFORE = {"model": {"block_size": 8, "steps": 2}, "resources": {"threads": 1}}


@pytest.fixture(scope="module")
def engine(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_engine(tmp_path_factory.mktemp("engine"), checkpoint, {"api_key": API_KEY})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plane(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A control plane with deployment MODEL (2 instances) on engine config BEFORE."""
    server = start_server(tmp_path_factory.mktemp("cp"))
    admin = Dctl({"XDG_CONFIG_HOME": server.env["XDG_CONFIG_HOME"]})
    for host in ("gpu-a", "gpu-b"):
        register_host(server, admin, host, gpus=1)
    assert admin("model", "register", f"{MODEL}:v1", str(checkpoint)).code == 0
    config = tmp_path_factory.mktemp("cfg") / "engine.yaml"
    config.write_text(yaml.safe_dump(BEFORE))
    created = admin("deploy", "create", MODEL, "--model", f"{MODEL}:v1", "--hosts",
                    "gpu-a,gpu-b", "--engine-config", str(config))  # fmt: skip
    assert created.code == 0, created.stderr
    yield server
    server.stop()


def env(plane: Server, token: str | None = None) -> dict[str, str]:
    return {
        "DCTL_API_KEY": API_KEY,
        "DCTL_URL": plane.url,
        "DCTL_TOKEN": token or plane.admin_token,
    }


def test_apply_starts_a_config_canary_with_the_keys_merged(
    engine: ServerProcess, plane: Server, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = dctl("tune", "--deployment", MODEL, "--base-url", f"{engine.url}/v1", *GRID,
                  "--apply", "-o", str(out), env=env(plane))  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert f"rollout of {MODEL} started" in result.stdout.replace("rollout 1 of", "rollout of")
    assert API_KEY not in result.stdout and plane.admin_token not in result.stdout

    recommendation = json.loads((out / "results.json").read_text())["recommendation"]
    recommended = recommendation["label"]
    applied = yaml.safe_load((out / "applied-engine-config.yaml").read_text())
    assert applied["resources"] == {"threads": 1}  # the rest of the config is kept
    keys = recommendation["engine_config"]["model"]
    assert applied["model"] == merged_engine_config(BEFORE, keys)["model"]
    assert applied["model"]["block_size"] == 4

    with ControlPlaneClient(plane.url, plane.admin_token) as api:
        rollout = api.get_rollout(MODEL)
        assert rollout.state == RolloutState.PROGRESSING
        assert rollout.engine_config_changed and rollout.weight in {0, 10}
        # Why it started is in the audit log (the record's reason follows its progress).
        events = api.list_events(limit=50).items
        assert any(f"dctl tune: {recommended}" in (e.message + str(e.data)) for e in events)
        assert rollout.steps[0] == 10
        # The stable version is untouched until the canary is analysed and promoted.
        assert api.get_deployment(MODEL).engine_config == BEFORE
        again = dctl("tune", "--deployment", MODEL, "--base-url", f"{engine.url}/v1", *GRID,
                     "--apply", "-o", str(tmp_path / "again"), env=env(plane))  # fmt: skip
        assert again.exit_code == 1 and "has an active rollout" in again.stderr
        assert "tuning" not in again.stderr  # refused before the sweep
        api.rollout_action(MODEL, "abort", RolloutAction(reason="test over"))


def test_an_unknown_deployment_fails_before_the_sweep(plane: Server, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = dctl("tune", "--deployment", "nope", "--base-url", "http://127.0.0.1:9/v1", *GRID,
                  "--apply", "-o", str(out), env=env(plane))  # fmt: skip
    assert result.exit_code == 1
    assert "nope" in result.stderr and "not found" in result.stderr
    assert not out.exists()  # nothing swept, nothing written


def test_apply_needs_a_deployment(checkpoint: Path) -> None:
    result = dctl("tune", str(checkpoint), "--apply", *GRID)
    assert result.exit_code == 2 and "give --deployment NAME" in result.stderr


def test_merging_keeps_every_other_key_and_drops_a_stale_steps_mode() -> None:
    current = {"model": {"block_size": 8, "steps": 2, "thinking": True}, "service": {"x": 1}}
    merged = merged_engine_config(current, {"block_size": 16, "threshold": 0.8})
    assert merged == {
        "model": {"block_size": 16, "thinking": True, "threshold": 0.8},
        "service": {"x": 1},
    }
    assert current["model"]["steps"] == 2  # the input is not changed
    steps = merged_engine_config(current, {"block_size": 4, "steps": 1})
    assert steps["model"] == {"block_size": 4, "steps": 1, "thinking": True}
