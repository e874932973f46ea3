"""Write `monitoring/grafana/dctl.json` from `dctl_dashboard.py`; `--check` only compares.

python -m monitoring.grafana            # regenerate after editing the dashboard's code
python -m monitoring.grafana --check    # exit 1 when dctl.json is stale or hand-edited
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from monitoring.grafana.dctl_dashboard import DASHBOARD

OUTPUT = Path(__file__).resolve().parent / "dctl.json"


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, compare) the generated dashboard; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m monitoring.grafana", description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.name}")
    args = parser.parse_args(argv)
    text = DASHBOARD.to_json()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is stale: run python -m monitoring.grafana", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
