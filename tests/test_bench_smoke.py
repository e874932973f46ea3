"""Every benchmark in bench/ runs in --smoke mode, so none of them rots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_smoke(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "a benchmark must print its figures"
