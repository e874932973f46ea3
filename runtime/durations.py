"""Durations as operators write them: `90s`, `5m`, `24h`, `7d` (a positive whole number and a unit).

One rule for every part: the CLI turns a None into a usage error naming the option, the TUI into
a message under the form field.
"""

from __future__ import annotations

import re

_DURATION = re.compile(r"^(\d+)\s*([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int | None:
    """Seconds for `90s`, `30m`, `24h`, `7d`; None when TEXT is not a positive duration."""
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        return None
    return int(match.group(1)) * _SECONDS[match.group(2)]
