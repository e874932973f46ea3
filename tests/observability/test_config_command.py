"""`dctl metrics config -o DIR`: the shipped Prometheus and Grafana files, written where an
operator asks, usable as written, and an operator's edits kept unless --force."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import monitoring
from tests.observability.conftest import ROOT

# Where each written file comes from in the checkout (not through `monitoring.artefact`, which
# is what is under test).
SHIPPED = {
    "prometheus.yml": ROOT / "monitoring" / "prometheus" / "prometheus.yml",
    "alerts.yml": ROOT / "monitoring" / "prometheus" / "alerts.yml",
    "alerts_test.yml": ROOT / "monitoring" / "prometheus" / "alerts_test.yml",
    "grafana-dashboard.json": ROOT / "monitoring" / "grafana" / "dctl.json",
    "vector.toml": ROOT / "monitoring" / "logs" / "vector.toml",
    "promtail.yml": ROOT / "monitoring" / "logs" / "promtail.yml",
}


def metrics_config(out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The real command, as a process started away from the checkout (so the `monitoring` it
    reads is the installed package, not a folder of the working directory)."""
    return subprocess.run(
        [sys.executable, "-m", "cli", "metrics", "config", "-o", str(out), *flags],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_writes_the_shipped_files_0644_into_a_new_directory(tmp_path: Path) -> None:
    out = tmp_path / "a" / "dctl-monitoring"
    result = metrics_config(out)
    assert result.returncode == 0, result.stderr
    assert set(SHIPPED) == set(monitoring.ARTEFACTS)
    assert sorted(p.name for p in out.iterdir()) == sorted(SHIPPED)
    for name, source in SHIPPED.items():
        assert (out / name).read_bytes() == source.read_bytes(), name
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    # What to run next names the files just written.
    assert f"--config.file={out / 'prometheus.yml'}" in result.stdout
    assert str(out / "grafana-dashboard.json") in result.stdout

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = metrics_config(out)
    assert again.returncode == 0, again.stderr
    assert "wrote" not in again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_promtool_accepts_the_written_config_and_rules(promtool: str, tmp_path: Path) -> None:
    out = tmp_path / "dctl-monitoring"
    assert metrics_config(out).returncode == 0
    (out / "targets.json").write_text("[]")  # what `dctl metrics targets -o` writes beside it
    config = run(promtool, "check", "config", str(out / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    assert "WARNING" not in config.stdout + config.stderr
    rules = run(promtool, "test", "rules", str(out / "alerts_test.yml"))
    assert rules.returncode == 0, rules.stdout + rules.stderr


def test_an_edited_file_is_kept_unless_force(tmp_path: Path) -> None:
    out = tmp_path / "dctl-monitoring"
    assert metrics_config(out).returncode == 0
    edited = out / "alerts.yml"
    edited.write_text(edited.read_text() + "# tuned for our fleet\n")
    (out / "prometheus.yml").unlink()

    refused = metrics_config(out)
    assert refused.returncode == 2
    assert str(edited) in refused.stderr and "--force" in refused.stderr
    assert edited.read_text().endswith("# tuned for our fleet\n")
    assert not (out / "prometheus.yml").exists(), "a refused run writes nothing"

    forced = metrics_config(out, "--force")
    assert forced.returncode == 0, forced.stderr
    for name, source in SHIPPED.items():
        assert (out / name).read_bytes() == source.read_bytes(), name


def test_a_file_in_the_way_of_the_directory_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "dctl-monitoring"
    blocker.write_text("not a directory")
    result = metrics_config(blocker)
    assert result.returncode == 2
    assert "not a directory" in result.stderr
