"""Durations as operators write them: `90s`, `5m`, `24h`, `7d` (a positive whole number and a unit).

One rule for every part: the CLI turns a None into a usage error naming the option, the TUI into
a message under the form field. Shown, a duration reads the same way (`5m`, `4m12s`, `1h02m`,
`1d`) wherever it is printed: the CLI, the TUI, the tuning sweep's progress.
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


def format_duration(seconds: float) -> str:
    """45 -> `45s`, 252 -> `4m12s`, 300 -> `5m`, 3720 -> `1h02m`, 7200 -> `2h`, 90000 -> `1d01h`.

    Two units at most, the smaller one left out when it is zero, so a whole duration reads as an
    operator would type it.
    """
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        count, rest, unit, smaller = whole // 60, whole % 60, "m", "s"
    elif whole < 86400:
        count, rest, unit, smaller = whole // 3600, whole % 3600 // 60, "h", "m"
    else:
        count, rest, unit, smaller = whole // 86400, whole % 86400 // 3600, "d", "h"
    return f"{count}{unit}{rest:02d}{smaller}" if rest else f"{count}{unit}"
