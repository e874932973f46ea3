"""The migrations ship inside the wheel: `dctl db upgrade` works from a non-editable install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
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


@pytest.mark.slow
def test_db_upgrade_from_an_installed_wheel(tmp_path: Path) -> None:
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
    where = subprocess.run(
        # The parts of their own (gateway, provision, doctor) ship too.
        [
            str(python),
            "-c",
            "import controlplane, gateway.main, provision.wheel, doctor, "
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
    dctl = str(fresh / "bin" / "dctl")
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
