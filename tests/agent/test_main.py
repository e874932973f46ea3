"""The agent's entry module: what `run` refuses before it starts anything, and how."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.errors import AgentFailure
from agent.gpu import FakeBackend
from agent.main import advertise_address, run, select_gpus
from agent.settings import SettingsError, load_agent_settings


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in list(os.environ):
        if var.startswith(("DCTL_", "XDG_")):
            monkeypatch.delenv(var)
    return tmp_path


def test_no_control_plane_is_a_settings_error_saying_where_to_give_one() -> None:
    with pytest.raises(SettingsError, match="control_plane is required: --control-plane URL"):
        run(load_agent_settings(allow_root=True))


def test_root_is_refused_without_allow_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    settings = load_agent_settings(control_plane="http://127.0.0.1:1")
    with pytest.raises(AgentFailure, match=r"refusing to run as root.*--allow-root"):
        run(settings)


def test_the_advertise_address_setting_wins_over_the_route() -> None:
    settings = load_agent_settings(control_plane="http://127.0.0.1:1", advertise_address="10.0.0.7")
    assert advertise_address(settings) == "10.0.0.7"


def test_fake_faults_are_injected_into_the_fake_backend_only() -> None:
    selection = select_gpus(
        load_agent_settings(gpu_backend="fake", fake_gpus="2xH200", fake_faults="lost:1")
    )
    assert isinstance(selection.backend, FakeBackend)
    assert [d.health for d in selection.backend.sample().devices][1] == "lost"
    with pytest.raises(SettingsError, match=r"fake_faults \(--fake-faults\): only the fake"):
        select_gpus(load_agent_settings(gpu_backend="nvml", fake_faults="lost:1"))
