"""Snapshot fetch throughput: what verifying weights costs the agent.

Writes a synthetic checkpoint (a few safetensors-sized files of random bytes), then fetches it
into a fresh `SnapshotStore` three ways and compares with a plain copy of the same bytes:

- local directory (stream copy + sha256 of every byte + atomic rename),
- HTTP from a loopback server with Range support (what an agent does against the control
  plane's file endpoint),
- HTTP resumed after the transfer was cut half way (hashes the kept half, fetches the rest).

Reports MB/s (median of the repeats) and the ratio to the plain copy: the price of never
serving an unverified byte. The anchor: GPUStack checks only ETags, so its copy is the plain one.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from agent.errors import SnapshotError
from agent.snapshots import SnapshotStore
from protocol.manifest import compute_manifest

MB = 1024 * 1024


def make_checkpoint(root: Path, files: int, file_mb: int) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"model_type": "qwen3_moe"}')
    for i in range(files):
        (root / f"model-{i:05d}-of-{files:05d}.safetensors").write_bytes(os.urandom(file_mb * MB))
    return root


class _Files(http.server.BaseHTTPRequestHandler):
    root: Path
    cut_after: int | None = None

    def do_GET(self) -> None:
        data = (self.root / self.path.lstrip("/")).read_bytes()
        start = 0
        if rng := self.headers.get("Range"):
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            self.send_response(206)
        else:
            self.send_response(200)
        body = data[start:]
        if start:  # a resumed fetch is checked against the range it asked for
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        cut = type(self).cut_after
        if cut is not None and len(body) > cut:
            type(self).cut_after = None
            self.wfile.write(body[:cut])
            self.connection.close()
            return
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def timed(fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.files, args.file_mb, args.repeats = 2, 4, 1
    with tempfile.TemporaryDirectory(prefix="dctl-bench-snap-") as tmp:
        base = Path(tmp)
        src = make_checkpoint(base / "src", args.files, args.file_mb)
        manifest = compute_manifest(src)
        total = manifest.total_bytes()
        handler: type[_Files] = type("Files", (_Files,), {"root": src})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        results: dict[str, list[float]] = {"plain copy": [], "local": [], "http": [], "resume": []}
        for n in range(args.repeats):
            results["plain copy"].append(timed(shutil.copytree, src, base / f"copy{n}"))
            local = SnapshotStore(base / f"local{n}", model_roots=[src])
            results["local"].append(timed(local.fetch, manifest, str(src)))
            remote = SnapshotStore(base / f"http{n}")
            results["http"].append(timed(remote.fetch, manifest, "s3://x", files_url=url))
            resumed = SnapshotStore(base / f"resume{n}")
            handler.cut_after = args.file_mb * MB // 2
            with contextlib.suppress(SnapshotError):  # the cut: half a file is kept for resume
                resumed.fetch(manifest, "s3://x", files_url=url)
            results["resume"].append(timed(resumed.fetch, manifest, "s3://x", files_url=url))
            for d in (f"copy{n}", f"local{n}", f"http{n}", f"resume{n}"):
                shutil.rmtree(base / d, ignore_errors=True)
        server.shutdown()
    plain = statistics.median(results["plain copy"])
    print(f"snapshot of {args.files} files, {total / MB:.0f} MiB; median of {args.repeats}")
    print(f"{'path':<12} {'seconds':>8} {'MB/s':>8} {'vs plain copy':>14}")
    for name, times in results.items():
        median = statistics.median(times)
        print(f"{name:<12} {median:>8.3f} {total / MB / median:>8.0f} {plain / median:>13.2f}x")


if __name__ == "__main__":
    main()
