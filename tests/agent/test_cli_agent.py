"""`dctl agent`, `dctl agent preflight` and `dctl agent verify` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from agent.snapshots import SnapshotStore
from protocol.manifest import compute_manifest

DCTL = [sys.executable, "-m", "cli"]


def dctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DCTL, *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def test_preflight_json_on_fake_gpus_and_a_failing_expectation(tmp_path: Path) -> None:
    ok = dctl("agent", "preflight", "--json", "--gpu-backend", "fake", "--fake-gpus", "1xA100",
              "--data-dir", str(tmp_path))  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] is True and report["gpu_backend"] == "fake"
    assert {c["name"] for c in report["checks"]} >= {"nvml", "gpu_count", "disk", "torch"}
    assert report["gpus"][0]["name"] == "NVIDIA A100-SXM4-80GB"
    bad = dctl("agent", "preflight", "--gpu-backend", "fake", "--fake-gpus", "1xA100",
               "--expected-gpus", "8", "--fake-faults", "ecc:0=2",
               "--data-dir", str(tmp_path))  # fmt: skip
    assert bad.returncode == 1
    assert "1 GPU(s) visible, 8 expected" in bad.stdout
    assert "uncorrectable ECC errors on GPU(s) {0: 2}" in bad.stdout


def test_bad_flags_are_usage_errors_naming_the_flag(tmp_path: Path) -> None:
    result = dctl("agent", "preflight", "--gpu-backend", "fake", "--fake-gpus", "2xTPU")
    assert result.returncode == 2 and "--fake-gpus" in result.stderr
    result = dctl("agent", "preflight", "--gpu-backend", "fake", "--fake-faults", "melt:0")
    assert result.returncode == 2 and "lost:INDEX" in result.stderr
    result = dctl("agent", "--control-plane", "http://127.0.0.1:1", "--ports", "9-1",
                  "--allow-root", "--data-dir", str(tmp_path))  # fmt: skip
    assert result.returncode == 2 and "--ports" in result.stderr


def test_agent_refuses_root_without_allow_root(tmp_path: Path) -> None:
    result = dctl("agent", "--control-plane", "http://127.0.0.1:1", "--data-dir", str(tmp_path))
    if os.geteuid() == 0:
        assert result.returncode == 1
        assert "refusing to run as root" in result.stderr and "--allow-root" in result.stderr
    else:  # an ordinary user gets past the check and fails on the missing bootstrap token
        assert "refusing" not in result.stderr


def test_verify_names_the_corrupted_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"\0" * 1024)
    store = SnapshotStore(tmp_path / "data" / "snapshots", model_roots=[tmp_path])
    path = store.fetch(compute_manifest(src), str(src))
    clean = dctl("agent", "verify", "--json", "--data-dir", str(tmp_path / "data"))
    assert clean.returncode == 0 and json.loads(clean.stdout)[0]["ok"] is True
    weights = path / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"\1" * 1024)
    broken = dctl("agent", "verify", "--json", "--data-dir", str(tmp_path / "data"))
    assert broken.returncode == 1
    assert json.loads(broken.stdout)[0]["bad_files"] == ["model.safetensors"]


def test_config_flag_reads_the_agent_table_and_flags_win(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[agent]\ngpu_backend = "fake"\nfake_gpus = "1xL4"\ndata_dir = "{tmp_path / "data"}"\n'
    )
    env = {"DCTL_CONFIG": str(tmp_path / "elsewhere.toml")}
    report = dctl("agent", "preflight", "--json", "--config", str(config), env=env)
    assert report.returncode == 0, report.stderr
    checks = json.loads(report.stdout)
    assert [g["name"] for g in checks["gpus"]] == ["NVIDIA L4"]
    [disk] = [c for c in checks["checks"] if c["name"] == "disk"]
    assert str(tmp_path / "data") in disk["reason"]  # the data dir the file names
    flagged = dctl("agent", "preflight", "--json", "--config", str(config),
                   "--fake-gpus", "2xA100", env=env)  # fmt: skip
    assert len(json.loads(flagged.stdout)["gpus"]) == 2


def test_a_bad_setting_stops_start_up_with_one_line_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\ncontrol_plane = "http://127.0.0.1:1"\nports = "9-1"\n')
    result = dctl("agent", "--config", str(config), "--allow-root", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: invalid setting ports (--ports, env DCTL_AGENT_PORTS): "
        "9-1: the first port is above the last"
    ]
    missing = dctl("agent", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "nope.toml does not exist" in missing.stderr
    no_cp = dctl(
        "agent", "--data-dir", str(tmp_path), env={"DCTL_CONFIG": str(config.with_name("x"))}
    )
    assert no_cp.returncode == 2 and "control_plane is required" in no_cp.stderr


def test_log_bounds_are_flags_checked_like_the_rest(tmp_path: Path) -> None:
    # A buffer smaller than one heartbeat's batch could never ship: refused, naming the flag.
    result = dctl("agent", "--control-plane", "http://127.0.0.1:1", "--allow-root",
                  "--data-dir", str(tmp_path), "--log-buffer-lines", "5")  # fmt: skip
    assert result.returncode == 2
    assert "log_buffer_lines (--log-buffer-lines" in result.stderr
    assert "greater than or equal to 2000" in result.stderr
