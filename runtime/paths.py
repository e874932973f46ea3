"""Where dctl keeps its files: XDG data and config directories."""

from __future__ import annotations

import os
from pathlib import Path


def data_dir() -> Path:
    """The data directory: `$XDG_DATA_HOME/dctl`, by default `~/.local/share/dctl`."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "dctl"


def config_dir() -> Path:
    """The config directory: `$XDG_CONFIG_HOME/dctl`, by default `~/.config/dctl`."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dctl"


def config_file() -> Path:
    """The optional settings file; `DCTL_CONFIG` points elsewhere (TOML or YAML)."""
    override = os.environ.get("DCTL_CONFIG")
    return Path(override) if override else config_dir() / "config.toml"
