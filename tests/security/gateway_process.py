"""A real `dctl gateway` process for the security tests: started, awaited until it has routes,
stopped (SIGTERM, then SIGKILL) however the test ends."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def gateway_serving(
    argv: list[str], env: Mapping[str, str], port: int, log_path: Path
) -> Iterator[str]:
    """Run ARGV (a `dctl gateway` on PORT, output to LOG_PATH) until it is ready; its base URL."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=dict(env), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{url}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not load its routes"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
