"""dctl's wheel: content digest stable across rebuilds, built from source once, cached."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from provision import wheel as wheel_module
from provision.ssh import ProvisionError
from provision.wheel import DctlWheel, running_wheel, wheel_digest, wheelhouse_files

CHECKOUT = Path(__file__).resolve().parents[2]
TINY_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "dctl"
version = "9.9.9"

[tool.setuptools.packages.find]
include = ["tiny*"]
"""


def pip_wheel(source: Path, out: Path, epoch: int = 1_600_000_000) -> Path:
    """Build SOURCE's wheel into OUT, its zip dates set to EPOCH (setuptools honours it)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        check=True, capture_output=True, env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)},
    )  # fmt: skip
    [built] = out.glob("*.whl")
    return built


def zip_dates(path: Path) -> set[tuple[int, ...]]:
    with zipfile.ZipFile(path) as archive:
        return {info.date_time for info in archive.infolist()}


@pytest.fixture
def tiny_source(tmp_path: Path) -> Path:
    """A minimal project named dctl: a pyproject.toml and one package of one module."""
    source = tmp_path / "tiny-src"
    (source / "tiny").mkdir(parents=True)
    (source / "pyproject.toml").write_text(TINY_PYPROJECT)
    (source / "tiny" / "__init__.py").write_text('"""Tiny."""\n\nANSWER = 42\n')
    return source


def test_digest_is_equal_for_two_builds_and_changes_with_the_source(
    tiny_source: Path, tmp_path: Path
) -> None:
    first = pip_wheel(tiny_source, tmp_path / "out-1", epoch=1_600_000_000)
    second = pip_wheel(tiny_source, tmp_path / "out-2", epoch=1_700_000_000)
    assert zip_dates(first).isdisjoint(zip_dates(second))
    assert wheel_digest(first) == wheel_digest(second)
    (tiny_source / "tiny" / "__init__.py").write_text('"""Tiny."""\n\nANSWER = 43\n')
    changed = pip_wheel(tiny_source, tmp_path / "out-3")
    assert wheel_digest(changed) != wheel_digest(first)


def test_digest_ignores_member_order_and_dates(tmp_path: Path) -> None:
    members = {"a.py": b"a = 1\n", "b/c.py": b"c = 2\n"}
    for name, order, date in (("x.whl", sorted, 1990), ("y.whl", reversed, 2020)):
        with zipfile.ZipFile(tmp_path / name, "w") as archive:
            for member in order(list(members)):
                archive.writestr(zipfile.ZipInfo(member, (date, 1, 1, 0, 0, 0)), members[member])
    assert wheel_digest(tmp_path / "x.whl") == wheel_digest(tmp_path / "y.whl")


def test_digest_of_a_non_wheel_is_a_provision_error(tmp_path: Path) -> None:
    (tmp_path / "broken.whl").write_text("not a zip")
    with pytest.raises(ProvisionError, match=r"broken\.whl"):
        wheel_digest(tmp_path / "broken.whl")


def test_this_checkout_is_found_as_the_source() -> None:
    assert wheel_module._source_dir() == CHECKOUT


@pytest.fixture(scope="module")
def checkout_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's wheel files, copied: other work on the checkout cannot change the key
    between two calls of one test."""
    copy = tmp_path_factory.mktemp("checkout")
    for relative in wheel_module._source_files(CHECKOUT):
        (copy / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(CHECKOUT / relative, copy / relative)
    return copy


@pytest.fixture(scope="module")
def built(
    checkout_copy: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DctlWheel, Path, float]]:
    """dctl's wheel built once for the module: (wheel, cache dir, build seconds)."""
    cache = tmp_path_factory.mktemp("wheel-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wheel_module, "_source_dir", lambda: checkout_copy)
        started = time.monotonic()
        wheel = running_wheel(cache_dir=cache)
        yield wheel, cache, time.monotonic() - started


def test_running_wheel_builds_dctl(built: tuple[DctlWheel, Path, float]) -> None:
    wheel, cache, _ = built
    assert wheel.path.is_file() and wheel.path.is_relative_to(cache)
    assert wheel.version == importlib.metadata.version("dctl")
    assert wheel.path.name == f"dctl-{wheel.version}-py3-none-any.whl"
    assert wheel.digest == wheel_digest(wheel.path)
    with zipfile.ZipFile(wheel.path) as archive:
        names = set(archive.namelist())
    parts = {"provision/wheel.py", "gateway/main.py", "doctor/__init__.py", "runtime/tls.py"}
    assert parts <= names
    assert f"dctl-{wheel.version}.dist-info/entry_points.txt" in names
    assert not any(name.startswith("tests/") for name in names)
    assert not any(name.endswith(".pyc") for name in names)


def test_second_call_uses_the_cache(
    built: tuple[DctlWheel, Path, float], checkout_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel, cache, build_s = built
    mtime = wheel.path.stat().st_mtime_ns
    monkeypatch.setattr(wheel_module, "_source_dir", lambda: checkout_copy)
    started = time.monotonic()
    again = running_wheel(cache_dir=cache)
    # Relative to the build this run measured: a stalled CI machine slows both.
    assert time.monotonic() - started < max(1.0, build_s / 2)
    assert again == wheel
    assert wheel.path.stat().st_mtime_ns == mtime


def test_a_source_change_builds_a_new_wheel(
    tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wheel_module, "_source_dir", lambda: tiny_source)
    cache = tmp_path / "cache"
    first = running_wheel(cache_dir=cache)
    assert first.version == "9.9.9"
    module = tiny_source / "tiny" / "__init__.py"
    module.write_text(module.read_text().replace("42", "43"))
    changed = running_wheel(cache_dir=cache)
    assert changed.digest != first.digest and changed.path != first.path
    module.write_text(module.read_text().replace("43", "42"))
    assert running_wheel(cache_dir=cache) == first  # still cached


def test_a_failed_build_says_so(
    tiny_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wheel_module, "_source_dir", lambda: tiny_source)
    pyproject = tiny_source / "pyproject.toml"
    pyproject.write_text(TINY_PYPROJECT.replace('"9.9.9"', '"not a version"'))
    with pytest.raises(ProvisionError, match="building dctl's wheel"):
        running_wheel(cache_dir=tmp_path / "cache")
    pyproject.write_text(TINY_PYPROJECT + "[broken\n")
    with pytest.raises(ProvisionError, match=r"pyproject\.toml"):
        running_wheel(cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())  # no half-built entry left


def test_regular_install_takes_the_wheel_from_the_wheelhouse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wheel_module, "_source_dir", lambda: None)
    version = importlib.metadata.version("dctl")
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    with zipfile.ZipFile(wheelhouse / "dctl-0.0.1-py3-none-any.whl", "w") as archive:
        archive.writestr("old.py", "")
    with pytest.raises(ProvisionError, match="--wheelhouse"):
        running_wheel(cache_dir=tmp_path / "cache", wheelhouse=wheelhouse)
    path = wheelhouse / f"dctl-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("cli/__init__.py", "")
    found = running_wheel(cache_dir=tmp_path / "cache", wheelhouse=wheelhouse)
    assert found == DctlWheel(path=path, version=version, digest=wheel_digest(path))


def test_regular_install_without_wheelhouse_names_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wheel_module, "_source_dir", lambda: None)
    with pytest.raises(ProvisionError, match="--wheelhouse DIR"):
        running_wheel(cache_dir=tmp_path / "cache")


def test_wheelhouse_files_are_wheels_and_sdists_sorted(tmp_path: Path) -> None:
    for name in ("b-1.0-py3-none-any.whl", "a-2.0.tar.gz", "README.txt", "c-1.0-py3-none-any.whl"):
        (tmp_path / name).write_text("")
    assert [path.name for path in wheelhouse_files(tmp_path)] == [
        "a-2.0.tar.gz", "b-1.0-py3-none-any.whl", "c-1.0-py3-none-any.whl",
    ]  # fmt: skip


def test_an_empty_or_missing_wheelhouse_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ProvisionError, match=r"\*\.whl"):
        wheelhouse_files(tmp_path)
    with pytest.raises(ProvisionError, match="not a directory"):
        wheelhouse_files(tmp_path / "missing")
