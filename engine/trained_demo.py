"""The trained demo model: a small SDAR-MoE checkpoint shipped as package data in `demo_model/`.

`install_trained_demo` copies it into a checkpoint directory of its own. Only
`generation_config.json` depends on the seed (its `dctl_demo_seed` field): the weights stay
byte-identical and decode exactly the same, yet each seed is a distinct snapshot digest, so a
demo can register and roll out "v1" and "v2" of the same trained model.
"""

from __future__ import annotations

import json
import os
import shutil
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from engine.demo_checkpoint import write_json
from engine.errors import CheckpointError

GENERATION_CONFIG = "generation_config.json"
SEED_KEY = "dctl_demo_seed"
_CHUNK = 1 << 20
_FILE_MODE = 0o644  # the packaged files may be private to whoever built the wheel


def trained_demo_source() -> Traversable:
    """The packaged `engine/demo_model` directory; raises CheckpointError when it is missing."""
    source = files("engine") / "demo_model"
    if not source.is_dir() or not source.joinpath("config.json").is_file():
        raise CheckpointError(
            f"the trained demo model is missing from this install ({source} has no "
            "config.json); reinstall dctl, or use `dctl model create-demo --random`"
        )
    return source


def trained_demo_files() -> list[str]:
    """Names of the files the trained demo model consists of, sorted."""
    return sorted(entry.name for entry in trained_demo_source().iterdir() if entry.is_file())


def install_trained_demo(directory: str | Path, *, seed: int = 0) -> Path:
    """Copy the trained demo model into `directory` (created if missing) and return its path.

    `seed` becomes `dctl_demo_seed` in `generation_config.json`; every other file is copied
    byte for byte. Raises ValueError for a negative seed or a directory that already holds
    files, CheckpointError when the packaged model is missing.
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (got {seed})")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new directory")
    source = trained_demo_source()
    names = trained_demo_files()
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        entry = source / name
        if name == GENERATION_CONFIG:
            config = json.loads(entry.read_text(encoding="utf-8"))
            config[SEED_KEY] = seed  # replaced in place, so the key order stays the packaged one
            write_json(out / name, config)
            os.chmod(out / name, _FILE_MODE)
        else:
            _copy(entry, out / name)
    return out


def _copy(entry: Traversable, target: Path) -> None:
    # O_EXCL: the directory was checked empty, so an existing file means someone else writes too.
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    with entry.open("rb") as src, os.fdopen(fd, "wb") as dst:
        shutil.copyfileobj(src, dst, _CHUNK)
    os.chmod(target, _FILE_MODE)  # the umask may have narrowed what os.open asked for
