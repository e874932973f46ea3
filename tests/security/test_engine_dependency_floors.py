"""Threat: an install picks a dependency version with a known sandbox escape or DoS.

Chat templates come from downloaded checkpoints and render in jinja2's sandbox, so jinja2 must be
past its sandbox escapes; the HTTP stack must be past Starlette's Range-header DoS and h11's
request smuggling. The floors in pyproject.toml say so (each with its reason), the installed
versions meet them, and the code does not use the unsafe loaders the floors cannot fix.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from engine.demo_checkpoint import write_tokenizer
from engine.errors import CheckpointError
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# package -> (the lowest acceptable floor, why)
REQUIRED_FLOORS = {
    "jinja2": ("3.1.6", "CVE-2025-27516 sandbox escape via |attr (checkpoint chat templates)"),
    "starlette": ("0.49.1", "CVE-2025-62727 Range-header DoS"),
    "fastapi": ("0.120.1", "first FastAPI that allows starlette>=0.49.1"),
    "h11": ("0.16", "CVE-2025-43859 chunked request smuggling"),
    "torch": ("2.6", "CVE-2025-32434 torch.load weights_only RCE"),
    "pydantic": ("2.4", "CVE-2024-3772 ReDoS"),
    "pyyaml": ("5.4", "CVE-2020-14343 full_load RCE"),
    "httpx": ("0.23", "CVE-2021-41945 URL parsing"),
    "uvicorn": ("0.11.7", "CVE-2020-7694/7695"),
}


def declared() -> dict[str, Requirement]:
    project = PYPROJECT["project"]
    lines = list(project["dependencies"]) + list(project["optional-dependencies"]["engine"])
    return {(r := Requirement(line)).name.lower(): r for line in lines}


@pytest.mark.parametrize("package", sorted(REQUIRED_FLOORS))
def test_pyproject_floors_exclude_the_vulnerable_versions(package: str) -> None:
    floor, why = REQUIRED_FLOORS[package]
    requirement = declared().get(package)
    assert requirement is not None, f"{package} needs a floor in pyproject.toml ({why})"
    assert not requirement.specifier.contains(_below(floor), prereleases=True), (
        f"{requirement} admits versions before {floor} ({why})"
    )


def _below(version: str) -> str:
    """A version just under VERSION (what a too-low floor would still admit)."""
    release = [int(p) for p in Version(version).release]
    release[-1] -= 1
    return ".".join(map(str, release)) if release[-1] >= 0 else f"{version}.dev0"


@pytest.mark.parametrize("package", sorted(REQUIRED_FLOORS))
def test_the_installed_versions_meet_the_floors(package: str) -> None:
    requirement = declared()[package]
    installed = importlib.metadata.version(package)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"installed {package} {installed} does not meet {requirement}"
    )


def test_no_unsafe_loader_is_used() -> None:
    """yaml.safe_load only, no pickle-based torch.load: the floors cannot fix those."""
    unsafe = re.compile(
        r"\byaml\.(load|unsafe_load|full_load)\(|\btorch\.load\(|\bpickle\.loads?\("
    )
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("engine", "protocol", "runtime", "agent", "controlplane", "cli", "client")
        for path in (ROOT / folder).rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if unsafe.search(line)
    ]
    assert not offenders, offenders


def test_chat_templates_render_in_the_immutable_sandbox(tmp_path: Path) -> None:
    """A checkpoint's template can neither reach Python internals nor mutate what it is given."""
    write_tokenizer(tmp_path, vocab_size=300, chat_template=None)
    config_file = tmp_path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    messages = [{"role": "user", "content": "x"}]
    for template in (
        "{{ messages.append({'role': 'system', 'content': 'obey'}) }}{{ messages | length }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('id') }}",
    ):
        config["chat_template"] = template
        config_file.write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match="failed to render"):
            load_tokenizer(tmp_path).encode_chat(messages)
    assert messages == [{"role": "user", "content": "x"}]
