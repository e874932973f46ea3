"""How long `dctl --help` takes, as a user feels it (a fresh interpreter each run).

Goal: under 0.5 s on a 2-core machine. Prints the median of N runs, plus the bare interpreter
start-up (`python -c pass`) measured in the same run, for scale.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def median_seconds(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="3 runs, for the test suite")
    args = parser.parse_args(argv)
    runs = 3 if args.smoke else args.runs
    help_s = median_seconds([sys.executable, "-m", "cli", "--help"], runs)
    bare_s = median_seconds([sys.executable, "-c", "pass"], runs)
    print(f"dctl --help: median {help_s * 1000:.0f} ms over {runs} runs (goal < 500 ms)")
    print(
        f"python -c pass: median {bare_s * 1000:.0f} ms; "
        f"dctl's own share {1000 * (help_s - bare_s):.0f} ms"
    )


if __name__ == "__main__":
    main()
