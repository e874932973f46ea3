"""Hosts files and per-host flags: what a user writes, and the errors that name what to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from provision.errors import InventoryError
from provision.inventory import (
    HostSpec,
    load_hosts,
    parse_extras,
    parse_labels,
    parse_setting,
)
from provision.registry import ProvisionedHost, Registry
from provision.target import SshTarget

BASE = HostSpec(target=SshTarget("root", "placeholder"), key_file=Path("/keys/id"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    return path


def test_a_list_of_hosts_takes_the_command_lines_flags_as_defaults(tmp_path: Path) -> None:
    hosts = load_hosts(
        write(tmp_path, "- ubuntu@gpu-01\n- host: ops@gpu-02:2222\n  sudo: true\n"), BASE
    )
    assert [str(h.target) for h in hosts] == ["ubuntu@gpu-01", "ops@gpu-02:2222"]
    assert [h.sudo for h in hosts] == [False, True]
    assert all(h.key_file == Path("/keys/id") for h in hosts)


def test_defaults_then_entries_override_each_field(tmp_path: Path) -> None:
    text = """
defaults:
  extras: [gpu]
  labels: {zone: a}
  set: {metrics_port: 0}
hosts:
  - host: root@10.0.0.1
    name: gpu-01
    labels: zone=b,rack=7
    set: {gpu_backend: fake}
  - host: root@10.0.0.2
    name: gpu-02
"""
    first, second = load_hosts(write(tmp_path, text), BASE)
    assert first.labels == {"zone": "b", "rack": "7"} and second.labels == {"zone": "a"}
    assert first.settings == {"metrics_port": 0, "gpu_backend": "fake"}
    assert second.settings == {"metrics_port": 0}
    assert first.extras == second.extras == ("gpu",)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("- host: root@a\n  colour: red\n", "unknown field 'colour'"),
        ("- name: gpu-01\n", "`host: USER@HOST[:PORT]` is missing"),
        ("- host: root@a\n  sudo: yes please\n", "sudo: write true or false"),
        ("- host: root@a\n  extras: [tui]\n", "unknown extra 'tui'"),
        ("- root@a\n- root@a\n", "listed twice"),
        ("hosts: []\n", "expected a list of hosts"),
        ("[unclosed\n", "not valid YAML"),
        ("- host: 'root@a:port'\n", "host 1: host:"),
    ],
)
def test_a_bad_hosts_file_is_refused_naming_the_entry_and_field(
    tmp_path: Path, text: str, named: str
) -> None:
    with pytest.raises(InventoryError, match=None) as caught:
        load_hosts(write(tmp_path, text), BASE)
    assert named in str(caught.value)
    assert str(tmp_path / "hosts.yaml") in str(caught.value)


def test_flags_parse_labels_extras_and_typed_settings() -> None:
    assert parse_labels("zone=a, rack=7") == {"zone": "a", "rack": "7"}
    with pytest.raises(InventoryError, match="'zone' is not KEY=VALUE"):
        parse_labels("zone")
    assert parse_extras("") == ()
    assert parse_extras("engine,gpu") == ("engine", "gpu")
    assert parse_setting("metrics_port=0") == ("metrics_port", 0)
    assert parse_setting("stop-engines-on-exit=true") == ("stop_engines_on_exit", True)
    assert parse_setting("gpu_backend=fake") == ("gpu_backend", "fake")
    with pytest.raises(InventoryError, match="KEY=VALUE"):
        parse_setting("=3")


def test_the_registry_remembers_targets_per_control_plane_in_a_private_file(
    tmp_path: Path,
) -> None:
    registry = Registry(tmp_path / "dctl" / "provisioned.json")
    host = ProvisionedHost("gpu-01", "root@10.0.0.1", "/opt/dctl", sudo=False)
    registry.put("https://cp-a", host)
    assert registry.get("https://cp-a", "gpu-01") == host
    assert registry.get("https://cp-b", "gpu-01") is None
    assert (registry.path.stat().st_mode & 0o777) == 0o600
    registry.forget("https://cp-a", "gpu-01")
    assert registry.get("https://cp-a", "gpu-01") is None
    registry.path.write_text("{not json")
    with pytest.raises(ValueError, match="fix or remove it"):
        registry.get("https://cp-a", "gpu-01")
