"""Tiny DiffusionGemma checkpoints (`checkpoints.VARIANTS`), each built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.engine.diffusion_gemma.checkpoints import VARIANTS, build_checkpoint


@pytest.fixture(scope="session")
def dg_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The directory of a named tiny checkpoint (a key of `VARIANTS`), built on first use."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            root = tmp_path_factory.mktemp(f"dg-{name}")
            built[name] = build_checkpoint(root / name, **VARIANTS[name])
        return built[name]

    return get
