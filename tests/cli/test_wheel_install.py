"""What ships inside the wheel works from a non-editable install: the migrations (`dctl db
upgrade`) and the monitoring files (`dctl metrics config`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def source_copy(dest: Path) -> Path:
    """The working tree's tracked and not-ignored files, so the build leaves ROOT untouched."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


@dataclass
class Installed:
    """dctl's wheel, built from the working tree and installed alone in a fresh venv."""

    wheel: Path
    python: Path
    dctl: str
    site: str
    env: dict[str, str]
    home: Path


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """One wheel build and install for every test here (building takes a while)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = source_copy(tmp_path / "src")
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("dctl-*.whl")

    # A fresh venv with the wheel alone; its dependencies come from our .venv through a .pth
    # line (a plain path entry: the editable install's finder there is never activated).
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    python = fresh / "bin" / "python"
    subprocess.run(
        [*pip, "--python", str(python), "install", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "zz_dctl_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path)}
    yield Installed(wheel, python, str(fresh / "bin" / "dctl"), site, env, tmp_path)


@pytest.mark.slow
def test_db_upgrade_from_an_installed_wheel(installed: Installed) -> None:
    python, site, env, tmp_path = installed.python, installed.site, installed.env, installed.home
    where = subprocess.run(
        # The parts of their own (gateway, provision, doctor) and the shared runtime ship too.
        [
            str(python),
            "-c",
            "import controlplane, gateway.main, provision.wheel, doctor, runtime.asgi_body, "
            "migrations; print(migrations.__file__)",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(site), f"migrations imported from {where}, not the wheel"

    db = f"sqlite:///{tmp_path / 'installed.db'}"
    dctl = installed.dctl
    upgrade = subprocess.run(
        [dctl, "db", "upgrade", "--db", db], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert upgrade.returncode == 0, upgrade.stderr
    from controlplane.migrate import head

    assert upgrade.stdout.strip() == f"database at {head()}"
    current = subprocess.run(
        [dctl, "db", "current", "--db", db], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert "up to date" in current.stdout, current.stderr


@pytest.mark.slow
def test_metrics_config_from_an_installed_wheel(installed: Installed) -> None:
    import monitoring

    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    for folder, filename in monitoring.ARTEFACTS.values():
        assert f"monitoring/{folder}/{filename}" in names, f"{folder}/{filename} is not shipped"

    out = installed.home / "prometheus-and-grafana"
    result = subprocess.run(
        [installed.dctl, "metrics", "config", "-o", str(out)],
        cwd=installed.home, env=installed.env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for name, (folder, filename) in monitoring.ARTEFACTS.items():
        assert (out / name).read_bytes() == (ROOT / "monitoring" / folder / filename).read_bytes()
