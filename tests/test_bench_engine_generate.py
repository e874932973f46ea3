"""`bench/engine_generate.py --family diffusion-gemma` runs end to end at tiny sizes and prints
what the issue asks for: ours, transformers' and the ratio at batch 1 and in aggregate, with
evidence that both sides did the same work (same tokens, same steps per canvas)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a subprocess that loads torch and transformers: ~10 s

ROOT = Path(__file__).resolve().parent.parent
RATE = r"\s+[\d.]+ \(\s*[\d.]+/CPU-s\)"
RATIO = r"\s+[\d.]+x \([\d.]+x by CPU\)"


def test_the_diffusion_gemma_family_prints_both_sides_and_their_ratios() -> None:
    result = subprocess.run(
        [sys.executable, "bench/engine_generate.py", "--family", "diffusion-gemma", "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "torch threads 1 " in out  # the smoke run's one thread, for both sides
    assert re.search(rf"^batch 1 \(median of 2\){RATE}{RATE}{RATIO}  goal >= 2x$", out, re.M)
    assert re.search(rf"^batch 4 aggregate, one by one{RATE}{RATE}{RATIO}  goal >= 5x$", out, re.M)
    assert re.search(rf"^batch 4 aggregate, batched gen\.{RATE}{RATIO}", out, re.M)
    # The same work on both sides: a random model never settles, so every canvas of both runs
    # to the checkpoint's 8 steps, and with the same seed the tokens are the same.
    assert "steps per canvas: ours median 8.0 (min 8, max 8), transformers median 8.0" in out
    assert "same tokens as transformers at batch 1: 2/2" in out
