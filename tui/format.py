"""How figures read on screen: ages, durations, bytes, rates, percents; N/A for what is missing.

Pure functions of their arguments (the clock comes in as `now`), so the views and the snapshot
tests agree on every character.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from runtime.durations import format_duration

if TYPE_CHECKING:
    from protocol.rollouts import MetricUnit

NA = "N/A"
NONE = "-"
_SPARKS = "▁▂▃▄▅▆▇█"
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def aware(moment: datetime) -> datetime:
    """MOMENT with a timezone: the API's naive datetimes are UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def seconds_since(moment: datetime | None, now: datetime) -> float | None:
    """Seconds from MOMENT to NOW (never negative), None without a moment."""
    if moment is None:
        return None
    return max(0.0, (aware(now) - aware(moment)).total_seconds())


def duration(seconds: float | None) -> str:
    """45 -> `45s`, 252 -> `4m12s`, 3720 -> `1h02m`, 90000 -> `1d01h`; None -> `-`."""
    return NONE if seconds is None else format_duration(seconds)


def age(moment: datetime | None, now: datetime) -> str:
    """How long ago MOMENT was, e.g. `14s`; `-` when it never happened."""
    return duration(seconds_since(moment, now))


def clock_time(moment: datetime) -> str:
    """A timestamp as `HH:MM:SS` in UTC (the event log's column)."""
    return aware(moment).astimezone(UTC).strftime("%H:%M:%S")


def size(value: int | float | None) -> str:
    """Bytes as a person reads them: `1.5 GiB`; None -> N/A."""
    if value is None:
        return NA
    amount = float(value)
    for unit in _BYTE_UNITS:
        if abs(amount) < 1024 or unit == _BYTE_UNITS[-1]:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    return f"{amount:.1f} {_BYTE_UNITS[-1]}"  # pragma: no cover - the loop always returns


def percent(value: float | None, digits: int = 0) -> str:
    """A percent figure (already 0..100): `42%`; None -> N/A."""
    return NA if value is None else f"{value:.{digits}f}%"


def ratio_percent(value: float | None) -> str:
    """A 0..1 ratio as a percent with two decimals: `0.25%`; None -> `-`."""
    return NONE if value is None else f"{value * 100:.2f}%"


def millis(seconds: float | None) -> str:
    """Seconds as whole milliseconds: `412 ms`; None -> `-`."""
    return NONE if seconds is None else f"{seconds * 1000:.0f} ms"


def number(value: float | None, digits: int = 2) -> str:
    """A plain figure with DIGITS decimals; None -> `-`."""
    return NONE if value is None else f"{value:.{digits}f}"


def optional(value: object, unit: str = "") -> str:
    """A driver-reported field: its value and unit, or N/A when the driver does not report it."""
    if value is None:
        return NA
    if isinstance(value, float):
        return f"{value:.0f}{unit}"
    return f"{value}{unit}"


def short_digest(digest: str) -> str:
    """`sha256:0123456789ab…` -> the first 12 hex digits, enough to tell snapshots apart."""
    return digest.removeprefix("sha256:")[:12]


def sparkline(values: list[float], width: int = 20, top: float | None = None) -> str:
    """The last WIDTH values as block characters scaled to TOP (default: their maximum)."""
    recent = values[-width:]
    if not recent:
        return ""
    ceiling = top if top is not None else max(recent)
    if ceiling <= 0:
        return _SPARKS[0] * len(recent)
    last = len(_SPARKS) - 1
    return "".join(_SPARKS[min(last, max(0, round(v / ceiling * last)))] for v in recent)


def bar(fraction: float | None, width: int = 10) -> str:
    """A horizontal gauge of WIDTH cells, e.g. `██████░░░░` for 0.6; N/A padded when unknown."""
    if fraction is None:
        return NA.ljust(width)
    filled = round(min(1.0, max(0.0, fraction)) * width)
    return "█" * filled + "░" * (width - filled)


def served(weight: int, share: float | None) -> str:
    """The canary's weight and the share of requests it was served: `20% (served 2%)`."""
    return f"{weight}%" if share is None else f"{weight}% (served {share * 100:.3g}%)"


def metric(unit: MetricUnit, value: float | None) -> str:
    """An analysis figure in its UNIT: ratios in %, seconds in ms, counts whole, the rest
    (means, ratios of means) with 2 decimals."""
    if value is None:
        return NONE
    if unit == "ratio":
        return ratio_percent(value)
    if unit == "seconds":
        return millis(value)
    return f"{value:.0f}" if unit == "count" else f"{value:.2f}"
