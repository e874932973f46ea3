"""bench/gpu_vllm_backend.py stops everything it started when interrupted: its `--fake-vllm` run
(control plane, agent, gateway, and GuideLLM's mock server as the engine) is sent SIGINT once
the instance is ready, exits 130 with a summary, and leaves no process of it alive. The run
that passes is tests/test_bench_smoke.py's."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import alive, descendants

pytestmark = pytest.mark.e2e  # a whole stack, as test_bench_smoke.py's runs
SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_vllm_backend.py"


def test_sigint_once_ready_tears_the_whole_stack_down(tmp_path: Path) -> None:
    run = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--fake-vllm", "--work-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=SCRIPT.parent.parent,
    )  # fmt: skip
    assert run.stdout is not None
    seen = []
    try:
        for line in run.stdout:
            seen.append(line)
            if "[PASS] instance ready" in line:
                break
        started = descendants(run.pid)  # the parts, the engine's wrapper and the mock server
        assert len(started) >= 5, "".join(seen)
        run.send_signal(signal.SIGINT)
        rest = run.stdout.read()
        code = run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert code == 130, "".join(seen) + rest
    assert "FAIL  interrupted" in rest and "result: FAIL" in rest
    deadline = time.monotonic() + 10  # the last ones may still be exiting after their SIGKILL
    while alive(started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive(started) == []
