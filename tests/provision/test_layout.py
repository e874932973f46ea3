"""Where things go on a host, the files written there, and the commands that run the agent."""

from __future__ import annotations

import getpass
import math
import os
import subprocess
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from agent.settings import AgentSettings, check_agent_config
from provision.facts import HostFacts
from provision.layout import (
    SERVICE_USER,
    UNIT_NAME,
    Layout,
    agent_config,
    choose_layout,
    running_command,
    start_detached_command,
    stop_command,
    systemd_unit,
)

FACTS = HostFacts(
    os_name="Debian GNU/Linux 12 (bookworm)", kernel="Linux", arch="x86_64",
    python="/usr/bin/python3.11", python_version=(3, 11, 2), has_venv=True,
    free_bytes=50 * 2**30, driver_version="550.54.15", gpu_count=8, systemd=True,
    uid=1000, user="ops", home="/home/ops", sudo=True,
)  # fmt: skip
ROOT = replace(FACTS, uid=0, user="root", home="/root")


def sh(command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)


def config_text(layout: Layout, **settings: object) -> str:
    return agent_config(
        control_plane="http://cp.example:8700",
        name="gpu-1",
        layout=layout,
        labels={"zone": "a", "rack.id": "r 7"},
        settings=settings,
    )


# choose_layout --------------------------------------------------------------------------------


def test_root_gets_the_system_layout() -> None:
    layout = choose_layout(ROOT, sudo=False, prefix=None)
    assert (layout.mode, layout.prefix, layout.run_as, layout.sudo) == (
        "system", "/opt/dctl", SERVICE_USER, "",
    )  # fmt: skip
    assert layout.unit_path == f"/etc/systemd/system/{UNIT_NAME}"
    assert layout.systemctl == "systemctl"
    assert (layout.venv, layout.wheels, layout.data_dir) == (
        "/opt/dctl/venv", "/opt/dctl/wheels", "/opt/dctl/data",
    )  # fmt: skip
    assert (layout.config_file, layout.token_file, layout.manifest_file) == (
        "/opt/dctl/agent.toml", "/opt/dctl/bootstrap-token", "/opt/dctl/provisioned.json",
    )  # fmt: skip
    assert (layout.pid_file, layout.log_file) == ("/opt/dctl/agent.pid", "/opt/dctl/agent.log")


def test_sudo_gets_the_system_layout_through_sudo() -> None:
    layout = choose_layout(FACTS, sudo=True, prefix="/srv/dctl/")
    assert (layout.mode, layout.prefix, layout.run_as, layout.sudo) == (
        "system", "/srv/dctl", SERVICE_USER, "sudo -n ",
    )  # fmt: skip
    assert layout.systemctl == "sudo -n systemctl"


def test_a_plain_user_gets_everything_under_its_home() -> None:
    layout = choose_layout(replace(FACTS, systemd=False), sudo=False, prefix=None)
    assert (layout.mode, layout.prefix, layout.run_as, layout.sudo, layout.systemd) == (
        "user", "/home/ops/.local/share/dctl-agent", "ops", "", False,
    )  # fmt: skip
    assert layout.unit_path == f"/home/ops/.config/systemd/user/{UNIT_NAME}"
    assert layout.systemctl == "systemctl --user"
    assert choose_layout(FACTS, sudo=False, prefix="~/dctl").prefix == "/home/ops/dctl"


@pytest.mark.parametrize("prefix", ["opt/dctl", "./dctl", "/", "/opt/my dctl", "/opt/%i"])
def test_a_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        choose_layout(ROOT, sudo=False, prefix=prefix)


# agent_config ---------------------------------------------------------------------------------


def test_agent_config_round_trips_through_the_agent_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in os.environ:
        if key.startswith("DCTL_AGENT_"):
            monkeypatch.delenv(key)
    layout = choose_layout(ROOT, sudo=False, prefix=str(tmp_path / "dctl"))
    text = agent_config(
        control_plane="http://cp.example:8700/",
        name="gpu-1",
        layout=layout,
        labels={"zone": "a", "rack.id": "r 7"},
        settings={"metrics_port": 9500, "startup_grace_s": 30.5, "stop_engines_on_exit": True},
        ca_file="/etc/dctl/ca.pem",
    )
    check_agent_config(text)
    table = tomllib.loads(text)["agent"]
    assert list(table) == sorted(table)
    config = tmp_path / "agent.toml"
    config.write_text(text)
    settings = AgentSettings.load(config)
    assert settings.control_plane == "http://cp.example:8700"
    assert settings.name == "gpu-1"
    assert settings.labels == {"zone": "a", "rack.id": "r 7"}
    assert settings.data_dir == Path(layout.data_dir)
    assert settings.bootstrap_token_file == Path(layout.token_file)
    assert settings.ca_file == Path("/etc/dctl/ca.pem")
    assert (settings.metrics_port, settings.startup_grace_s) == (9500, 30.5)
    assert settings.stop_engines_on_exit is True


def test_an_unknown_setting_is_refused_by_name() -> None:
    text = config_text(choose_layout(ROOT, sudo=False, prefix=None), metrics_prot=9500)
    with pytest.raises(ValueError, match="metrics_prot"):
        check_agent_config(text)


def test_a_bad_value_is_refused_by_name() -> None:
    text = config_text(choose_layout(ROOT, sudo=False, prefix=None), metrics_port=99999)
    with pytest.raises(ValueError, match="metrics_port"):
        check_agent_config(text)


def test_check_reads_only_the_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This machine's env and config file say nothing about the remote host's.
    (tmp_path / "config.toml").write_text('[agent]\nfake_gpus = "bogus"\n')
    monkeypatch.setenv("DCTL_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("DCTL_AGENT_METRICS_PORT", "99999")
    check_agent_config(config_text(choose_layout(ROOT, sudo=False, prefix=None)))


def test_not_toml_or_no_agent_table_is_refused() -> None:
    with pytest.raises(ValueError, match="TOML"):
        check_agent_config("[agent\n")
    with pytest.raises(ValueError, match=r"\[agent\]"):
        check_agent_config("[server]\nport = 1\n")


@pytest.mark.parametrize("key", ["name", "labels", "data_dir", "bootstrap_token"])
def test_settings_provisioning_writes_are_refused_in_set(key: str) -> None:
    with pytest.raises(ValueError, match=f"--set {key}"):
        config_text(choose_layout(ROOT, sudo=False, prefix=None), **{key: "x"})


def test_every_value_type_is_valid_toml() -> None:
    values: dict[str, object] = {
        "text": 'quote " backslash \\ newline \n tab \t del \x7f é 😀',
        "whole": -42,
        "big": 2**62,
        "real": 0.1,
        "huge": 1e300,
        "tiny": 5e-324,
        "yes": True,
        "no": False,
        "items": ["a", 1, 2.5, False, ["nested"]],
        "pair": (18000, 18099),
        "table": {"b": 1, "a": {"deep": "x"}, "odd key": "v"},
        "empty": {},
        "path": Path("/opt/dctl"),
        "unset": None,
    }
    table = tomllib.loads(config_text(choose_layout(ROOT, sudo=False, prefix=None), **values))
    agent = table["agent"]
    for key, value in values.items():
        if value is None:
            assert key not in agent
        elif isinstance(value, tuple):
            assert agent[key] == list(value)
        elif isinstance(value, Path):
            assert agent[key] == str(value)
        else:
            assert agent[key] == value, key
    special = {"inf": math.inf, "minus": -math.inf, "nan": math.nan}
    parsed = tomllib.loads(config_text(choose_layout(ROOT, sudo=False, prefix=None), **special))
    assert parsed["agent"]["inf"] == math.inf and parsed["agent"]["minus"] == -math.inf
    assert math.isnan(parsed["agent"]["nan"])


def test_a_value_toml_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="setting must be"):
        config_text(choose_layout(ROOT, sudo=False, prefix=None), when=object())


# systemd_unit ---------------------------------------------------------------------------------


def unit_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_system_unit_runs_the_venv_dctl_as_the_service_user() -> None:
    layout = choose_layout(ROOT, sudo=False, prefix=None)
    lines = unit_lines(systemd_unit(layout))
    assert "ExecStart=/opt/dctl/venv/bin/dctl agent --config /opt/dctl/agent.toml" in lines
    assert f"User={SERVICE_USER}" in lines
    for line in ("After=network-online.target", "Restart=on-failure", "RestartSec=5",
                 "Environment=PYTHONUNBUFFERED=1", "WorkingDirectory=/opt/dctl",
                 "NoNewPrivileges=yes", "ReadWritePaths=/opt/dctl",
                 "WantedBy=multi-user.target"):  # fmt: skip
        assert line in lines
    assert lines.index("[Unit]") < lines.index("[Service]") < lines.index("[Install]")


def test_user_unit_has_no_user_line() -> None:
    layout = choose_layout(FACTS, sudo=False, prefix=None)
    lines = unit_lines(systemd_unit(layout))
    venv = "/home/ops/.local/share/dctl-agent"
    assert f"ExecStart={venv}/venv/bin/dctl agent --config {venv}/agent.toml" in lines
    assert not any(line.startswith("User=") for line in lines)
    assert "WantedBy=default.target" in lines


# The commands ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        choose_layout(ROOT, sudo=False, prefix=None),
        choose_layout(FACTS, sudo=True, prefix=None),
        choose_layout(FACTS, sudo=False, prefix=None),
        choose_layout(replace(ROOT, systemd=False), sudo=False, prefix=None),
        choose_layout(replace(FACTS, systemd=False), sudo=True, prefix=None),
        choose_layout(replace(FACTS, systemd=False), sudo=False, prefix=None),
    ],
)
def test_every_command_is_valid_sh(layout: Layout) -> None:
    for command in (start_detached_command(layout), stop_command(layout),
                    running_command(layout)):  # fmt: skip
        done = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr)


def test_commands_switch_to_the_service_user() -> None:
    as_root = choose_layout(replace(ROOT, systemd=False), sudo=False, prefix=None)
    assert start_detached_command(as_root).startswith(f"runuser -u {SERVICE_USER} -- sh -c ")
    via_sudo = choose_layout(replace(FACTS, systemd=False), sudo=True, prefix=None)
    assert start_detached_command(via_sudo).startswith(f"sudo -n -u {SERVICE_USER} sh -c ")
    with_systemd = choose_layout(FACTS, sudo=True, prefix=None)
    assert "sudo -n systemctl stop dctl-agent.service" in stop_command(with_systemd)
    assert "sudo -n systemctl disable dctl-agent.service" in stop_command(with_systemd)
    assert running_command(with_systemd) == "sudo -n systemctl is-active --quiet " + UNIT_NAME


def local_layout(tmp_path: Path, dctl_body: str) -> Layout:
    """A user layout in TMP_PATH whose `dctl` is a small sh script."""
    layout = Layout(
        mode="user", prefix=str(tmp_path / "prefix"), run_as=getpass.getuser(), sudo="",
        systemd=False, home=str(tmp_path),
    )  # fmt: skip
    dctl = Path(layout.venv) / "bin" / "dctl"
    dctl.parent.mkdir(parents=True)
    dctl.write_text(f"#!/bin/sh\n{dctl_body}\n")
    dctl.chmod(0o755)
    return layout


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_detached_agent_starts_once_and_stops(tmp_path: Path) -> None:
    args = tmp_path / "args"
    layout = local_layout(tmp_path, f'echo "$@" > {args}\nwhile :; do sleep 1; done')
    assert sh(running_command(layout)).returncode != 0

    started = sh(start_detached_command(layout))
    assert started.returncode == 0, started.stderr
    pid = int(Path(layout.pid_file).read_text())
    try:
        assert is_running(pid)
        assert args.read_text().split() == ["agent", "--config", layout.config_file]
        assert sh(running_command(layout)).returncode == 0
        again = sh(start_detached_command(layout))
        assert again.returncode == 0 and "already running" in again.stdout
        assert int(Path(layout.pid_file).read_text()) == pid

        assert sh(stop_command(layout)).returncode == 0
        assert not is_running(pid)
        assert sh(running_command(layout)).returncode != 0
        assert not Path(layout.pid_file).exists()
        assert sh(stop_command(layout)).returncode == 0
    finally:
        if is_running(pid):
            os.kill(pid, 9)


def test_a_stale_pid_file_is_not_the_agent(tmp_path: Path) -> None:
    layout = local_layout(tmp_path, "exit 0")
    Path(layout.pid_file).write_text(f"{os.getpid()}\n")  # alive, but not the agent
    assert sh(running_command(layout)).returncode != 0
    assert sh(stop_command(layout)).returncode == 0
    assert not Path(layout.pid_file).exists()


def test_an_agent_that_exits_at_once_fails_the_start(tmp_path: Path) -> None:
    layout = local_layout(tmp_path, "echo 'bad config' >&2; exit 3")
    done = sh(start_detached_command(layout))
    assert done.returncode != 0
    assert "bad config" in done.stderr
