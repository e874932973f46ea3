"""The wheel of the running dctl, which provisioning installs on every host.

From a source checkout or an editable install the wheel is built on the fly (`pip wheel`, from a
copy of exactly the files that go into it, so stale build/ leftovers cannot slip in) and cached,
keyed by a hash of those files: a second run builds nothing. A regular install cannot rebuild
itself: its wheel comes from `--wheelhouse`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

DIST_NAME = "dctl"
# Files at the top of a checkout that shape the wheel besides the packages.
_BUILD_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE")
_SKIP_DIRS = {"__pycache__"}
_SKIP_SUFFIXES = {".pyc", ".pyo"}
# Built wheels kept in the cache; older ones are removed (each is a dozen MB).
_CACHE_KEEP = 3


@dataclass(frozen=True)
class DctlWheel:
    """A dctl wheel on this machine."""

    path: Path  # local .whl file
    version: str  # dctl version in it
    digest: str  # wheel_digest(path): equal for rebuilds of the same source


def wheel_digest(path: Path) -> str:
    """sha256 over the sorted (member name, sha256 of member bytes) of the wheel at PATH.

    Zip timestamps and member order do not count, so two builds of one source are equal.
    """
    from provision.ssh import ProvisionError

    outer = hashlib.sha256()
    try:
        with zipfile.ZipFile(path) as archive:
            for name in sorted(archive.namelist()):
                outer.update(f"{name}\0{hashlib.sha256(archive.read(name)).hexdigest()}\n".encode())
    except (OSError, zipfile.BadZipFile) as exc:
        raise ProvisionError(
            f"{path}: not a readable wheel ({exc}); rebuild or replace it"
        ) from None
    return outer.hexdigest()


def running_wheel(cache_dir: Path | None = None, wheelhouse: Path | None = None) -> DctlWheel:
    """The wheel of the running dctl: built from its source (cached in CACHE_DIR, default
    ~/.cache/dctl/wheels), or for a regular install taken from WHEELHOUSE."""
    from provision.ssh import ProvisionError

    source = _source_dir()
    if source is not None:
        return _built_wheel(source, cache_dir or _default_cache_dir())
    version = importlib.metadata.version(DIST_NAME)
    found = sorted(wheelhouse.glob(f"{DIST_NAME}-{version}-*.whl")) if wheelhouse else []
    if not found:
        where = f"{wheelhouse} holds no {DIST_NAME}-{version}-*.whl" if wheelhouse else "no wheel"
        raise ProvisionError(
            f"dctl {version} is a regular install, so its wheel cannot be built here ({where}): "
            f"pass --wheelhouse DIR holding it (e.g. `pip download dctl=={version} --no-deps "
            "-d DIR`)"
        )
    return DctlWheel(path=found[-1], version=version, digest=wheel_digest(found[-1]))


def wheelhouse_files(wheelhouse: Path) -> list[Path]:
    """The wheels (*.whl) and sdists (*.tar.gz) in WHEELHOUSE, sorted; ProvisionError if none."""
    from provision.ssh import ProvisionError

    if not wheelhouse.is_dir():
        raise ProvisionError(f"--wheelhouse {wheelhouse}: not a directory; give one with wheels")
    files = sorted(
        path
        for pattern in ("*.whl", "*.tar.gz")
        for path in wheelhouse.glob(pattern)
        if path.is_file()
    )
    if not files:
        raise ProvisionError(
            f"--wheelhouse {wheelhouse} holds no *.whl or *.tar.gz: fill it with "
            "`pip download 'dctl[engine,gpu]' -d DIR` (or `pip wheel`) on a machine that can "
            "reach a package index"
        )
    return files


def _source_dir() -> Path | None:
    """The source checkout the running dctl comes from, or None for a regular install."""
    # The running code first: the checkout holding this package.
    here = Path(__file__).resolve().parent.parent
    if _is_dctl_source(here):
        return here
    try:
        direct_url = importlib.metadata.distribution(DIST_NAME).read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        return None
    if not direct_url:
        return None
    info = json.loads(direct_url)
    url = urlsplit(info.get("url", ""))
    if not info.get("dir_info", {}).get("editable") or url.scheme != "file":
        return None
    path = Path(unquote(url.path))
    return path if _is_dctl_source(path) else None


def _is_dctl_source(path: Path) -> bool:
    try:
        project = tomllib.loads((path / "pyproject.toml").read_text()).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return False
    return bool(project.get("name") == DIST_NAME)


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dctl" / "wheels"


def _source_files(source: Path) -> list[Path]:
    """The files of SOURCE that go into the wheel (relative paths, sorted): the build files and
    everything in the packages setuptools finds (over-inclusive: a rebuild too many is cheap,
    a stale wheel is not)."""
    readme = _pyproject(source).get("project", {}).get("readme")
    names = {*_BUILD_FILES, *([readme] if isinstance(readme, str) else [])}
    files = [Path(name) for name in names if (source / name).is_file()]
    for top in _package_roots(source):
        for dirpath, dirnames, filenames in os.walk(source / top):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for filename in filenames:
                path = Path(dirpath, filename)
                if path.suffix not in _SKIP_SUFFIXES and path.is_file():
                    files.append(path.relative_to(source))
    return sorted(files)


def _package_roots(source: Path) -> list[str]:
    """Top-level package directories: `[tool.setuptools.packages.find] include`, else every
    top-level directory with an `__init__.py` except tests."""
    find = (
        _pyproject(source).get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {})
    )
    patterns = find.get("include") or []
    names = {str(p).split(".")[0].rstrip("*") for p in patterns}
    if not names:
        names = {p.parent.name for p in source.glob("*/__init__.py")} - {"tests"}
    return sorted(name for name in names if name and (source / name).is_dir())


def _pyproject(source: Path) -> dict[str, Any]:
    from provision.ssh import ProvisionError

    try:
        return tomllib.loads((source / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ProvisionError(
            f"{source / 'pyproject.toml'}: cannot be read ({exc}); fix it"
        ) from None


def _source_key(source: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for relative in files:
        digest.update(f"{relative.as_posix()}\0".encode())
        digest.update(hashlib.sha256((source / relative).read_bytes()).digest())
    return digest.hexdigest()


def _built_wheel(source: Path, cache_dir: Path) -> DctlWheel:
    """The wheel of SOURCE from the cache, built into it first when missing."""
    from provision.ssh import ProvisionError

    files = _source_files(source)
    entry = cache_dir / _source_key(source, files)[:32]
    cached = _cached(entry)
    if cached is not None:
        return cached
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    except OSError as exc:
        raise ProvisionError(
            f"cannot write the wheel cache {cache_dir}: {exc.strerror}; make it writable"
        ) from None
    try:
        copy = work / "src"
        for relative in files:
            (copy / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / relative, copy / relative)
        out = work / "out"
        _pip_wheel(copy, out)
        wheel = next(out.glob(f"{DIST_NAME}-*.whl"))
        (out / (wheel.name + ".digest")).write_text(wheel_digest(wheel) + "\n")
        try:
            out.rename(entry)  # atomic: a concurrent build of the same key may have won
        except OSError:
            if _cached(entry) is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _prune(cache_dir, keep=entry)
    built = _cached(entry)
    assert built is not None  # just renamed into place
    return built


def _pip_wheel(source: Path, out: Path) -> None:
    from provision.ssh import ProvisionError

    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    command += ["--no-build-isolation", "--disable-pip-version-check", "-w", str(out), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ProvisionError(
            f"building dctl's wheel from {source} failed (exit {result.returncode}): {tail}\n"
            "pip and setuptools must be installed in the environment dctl runs from"
        )


def _cached(entry: Path) -> DctlWheel | None:
    wheels = sorted(entry.glob(f"{DIST_NAME}-*.whl")) if entry.is_dir() else []
    if not wheels:
        return None
    wheel = wheels[-1]
    try:
        digest = Path(str(wheel) + ".digest").read_text().strip()
    except OSError:
        digest = wheel_digest(wheel)
    return DctlWheel(path=wheel, version=wheel.name.split("-")[1], digest=digest)


def _prune(cache_dir: Path, keep: Path) -> None:
    """Remove all but the newest cache entries (KEEP always stays)."""
    entries = [p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    entries.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[_CACHE_KEEP:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)
