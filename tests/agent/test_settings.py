"""Agent settings: defaults < [agent] table < DCTL_AGENT_* env < flags, and one-line errors."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from agent.host_facts import route_address
from agent.settings import AgentSettings, SettingsError, load_agent_settings


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    for var in list(os.environ):
        if var.startswith(("DCTL_", "XDG_")):
            monkeypatch.delenv(var)
    return tmp_path


def write_config(home: Path, text: str) -> Path:
    path = home / ".config" / "dctl" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_defaults(isolated_home: Path) -> None:
    settings = load_agent_settings()
    assert settings.data_dir == isolated_home / ".local" / "share" / "dctl"
    assert settings.ports == (18000, 18099)
    assert (settings.gpu_backend, settings.fake_gpus, settings.metrics_port) == (
        "auto",
        "2xH200",
        9401,
    )
    assert settings.control_plane is None and settings.advertise_address is None
    assert settings.read_bootstrap_token() is None


def test_file_then_env_then_flags(isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(
        isolated_home,
        '[agent]\ncontrol_plane = "http://cp:8700/"\nports = "19000-19009"\nmetrics_port = 9500\n'
        'labels = {rack = "r1"}\nadvertise_address = "10.0.0.5"\n',
    )
    settings = load_agent_settings()
    assert settings.control_plane == "http://cp:8700"
    assert (settings.ports, settings.metrics_port, settings.labels) == (
        (19000, 19009),
        9500,
        {"rack": "r1"},
    )
    monkeypatch.setenv("DCTL_AGENT_PORTS", "19100-19109")
    monkeypatch.setenv("DCTL_AGENT_LABELS", "rack=r2,zone=z")
    settings = load_agent_settings()
    assert (settings.ports, settings.metrics_port) == ((19100, 19109), 9500)
    assert settings.labels == {"rack": "r2", "zone": "z"}
    settings = load_agent_settings(ports="19200-19209", labels=["rack=r3"], metrics_port=None)
    assert (settings.ports, settings.labels, settings.metrics_port) == (
        (19200, 19209),
        {"rack": "r3"},
        9500,
    )
    assert settings.advertise_address == "10.0.0.5"


def test_control_plane_env_vars_are_not_the_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    # One machine can run both: the control plane's DCTL_PORT / DCTL_DATA_DIR stay its own.
    monkeypatch.setenv("DCTL_DATA_DIR", "/srv/controlplane")
    monkeypatch.setenv("DCTL_PORT", "9999")
    monkeypatch.setenv("DCTL_AGENT_DATA_DIR", "/srv/agent")
    assert load_agent_settings().data_dir == Path("/srv/agent")


def test_config_flag_names_the_file_and_it_must_exist(
    isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_config(isolated_home, '[agent]\nfake_gpus = "1xL4"\n')
    named = isolated_home / "agent.yaml"
    named.write_text("agent:\n  fake_gpus: 2xA100\n  gpu_backend: fake\n")
    settings = load_agent_settings(named)
    assert (settings.fake_gpus, settings.gpu_backend) == ("2xA100", "fake")
    assert load_agent_settings().fake_gpus == "1xL4"  # the named file was only for that load
    monkeypatch.setenv("DCTL_CONFIG", str(named))
    assert load_agent_settings().fake_gpus == "2xA100"
    with pytest.raises(SettingsError, match=r"config file .*missing.toml does not exist"):
        load_agent_settings(isolated_home / "missing.toml")


@pytest.mark.parametrize(
    ("table", "overrides", "needle"),
    [
        ('ports = "9-1"', {}, r"invalid setting ports \(--ports, env DCTL_AGENT_PORTS\)"),
        ('ports = "many"', {}, "FIRST-LAST"),
        ("metrics_port = 70000", {}, "metrics_port"),
        ('gpu_backend = "tpu"', {}, "gpu_backend"),
        ('fake_gpus = "2xTPU"', {}, "unknown model 'TPU'"),
        ('fake_faults = "melt:0"', {}, "lost:INDEX"),
        ('control_plane = "cp:8700"', {}, "control_plane.*http"),
        ('advertise_address = "0.0.0.0"', {}, "advertise_address.*every interface"),
        ("", {"labels": ["novalue"]}, r"labels \(--label.*KEY=VALUE"),
        ("", {"labels": ["bad key=1"]}, "label key 'bad key'"),
        ("", {"name": "Not_A_Label"}, "invalid setting name"),
        ("prots = 1", {}, "unknown setting 'prots'"),
    ],
)
def test_a_bad_value_names_the_setting(
    isolated_home: Path, table: str, overrides: dict[str, Any], needle: str
) -> None:
    write_config(isolated_home, f"[agent]\n{table}\n")
    with pytest.raises(SettingsError, match=needle) as caught:
        load_agent_settings(**overrides)
    assert "\n" not in str(caught.value)


def test_bootstrap_token_from_a_file_or_a_value(
    isolated_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = isolated_home / "bootstrap"
    write_config(isolated_home, f'[agent]\nbootstrap_token_file = "{token_file}"\n')
    with caplog.at_level(logging.WARNING):
        assert load_agent_settings().read_bootstrap_token() is None  # used and deleted: fine
    assert "does not exist" in caplog.text
    token_file.write_text("dctl_boot_secret\n")
    token_file.chmod(0o600)
    settings = load_agent_settings()
    assert settings.read_bootstrap_token() == "dctl_boot_secret"
    assert "dctl_boot_secret" not in repr(settings)
    assert load_agent_settings(bootstrap_token="given").read_bootstrap_token() == "given"
    token_file.write_text("  \n")
    with pytest.raises(SettingsError, match=r"bootstrap_token_file: .* is empty"):
        load_agent_settings().read_bootstrap_token()


def test_loose_token_file_permissions_are_warned_about(
    isolated_home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token_file = isolated_home / "bootstrap"
    token_file.write_text("dctl_boot_secret")
    token_file.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        AgentSettings(bootstrap_token_file=token_file).read_bootstrap_token()
    assert "chmod 600" in caplog.text


def test_the_default_advertise_address_routes_to_the_control_plane() -> None:
    # A UDP connect picks the route without sending anything; loopback stays loopback.
    assert route_address("http://127.0.0.1:8700") == "127.0.0.1"
    assert route_address("https://localhost/") in {"127.0.0.1", "::1"}
    with pytest.raises(OSError, match="names no host"):
        route_address("http:///api")
