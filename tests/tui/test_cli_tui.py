"""`dctl tui`'s arguments: a bad --refresh or an unknown --context is a usage error (exit 2)
with one line saying what to write; good ones reach the app (its `run` replaced here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli.app import app
from cli.exits import FAILURE, USAGE
from client.credentials import CredentialsFile


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Config and credentials under TMP_PATH, one context `lab`, no DCTL_* from outside."""
    for name in ("DCTL_URL", "DCTL_TOKEN", "DCTL_CONTEXT", "DCTL_CA_FILE", "DCTL_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def add_context(name: str, url: str) -> None:
    CredentialsFile().add(url, "dctl_secret", name=name)


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["tui", *args])


@pytest.mark.parametrize("refresh", ["soon", "0s", "2", "-1s"])
def test_bad_refresh_is_a_usage_error(home: Path, refresh: str) -> None:
    result = invoke("--refresh", refresh)
    assert result.exit_code == USAGE
    assert "--refresh" in result.output and "30m" in result.output


def test_unknown_context_is_a_usage_error(home: Path) -> None:
    add_context("lab", "http://127.0.0.1:9")
    result = invoke("--context", "nope")
    assert result.exit_code == USAGE
    assert "no context named 'nope'" in result.output and "lab" in result.output


def test_no_control_plane_configured_fails(home: Path) -> None:
    result = invoke()
    assert result.exit_code == FAILURE
    assert "no control plane configured" in result.output


def test_good_arguments_reach_the_app(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tui.app import DctlApp

    add_context("lab", "http://127.0.0.1:9")
    started: list[DctlApp] = []
    monkeypatch.setattr(DctlApp, "run", lambda self, *a, **k: started.append(self))
    result = invoke("--context", "lab", "--readonly", "--refresh", "5s")
    assert result.exit_code == 0, result.output
    (tui,) = started
    assert (tui.context_name, tui.readonly, tui.refresh_s) == ("lab", True, 5)
    assert tui.client.base_url == "http://127.0.0.1:9"
