"""The decoding settings a sweep measures, and the option syntax that names them.

For every block size B the grid holds the reference (steps mode with S = B: one token per
denoising step, the most careful decode), one threshold-mode setting per threshold and one
steps-mode setting per steps value S <= B. Parsing errors are `GridError`s whose message names
the option and what to write instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_BLOCK_SIZES = (4, 8, 16, 32)
DEFAULT_THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95)


class GridError(ValueError):
    """An option value that does not name a valid grid; the message says what to write."""


@dataclass(frozen=True)
class DecodeSetting:
    """One point of the grid: a block size and how its blocks are unmasked.

    Exactly one of `threshold` (threshold mode) and `steps` (steps mode) is set. `reference`
    marks the steps = block_size setting that the others of its block size are compared with.
    """

    block_size: int
    threshold: float | None = None
    steps: int | None = None
    reference: bool = False

    @property
    def mode(self) -> str:
        """`threshold` or `steps`."""
        return "steps" if self.steps is not None else "threshold"

    @property
    def label(self) -> str:
        """A short name for tables and plots: `B8 t=0.9`, `B8 steps=2`, `B8 ref`."""
        if self.reference:
            return f"B{self.block_size} ref"
        if self.steps is not None:
            return f"B{self.block_size} steps={self.steps}"
        return f"B{self.block_size} t={self.threshold:g}"

    def request_fields(self) -> dict[str, Any]:
        """The decoding fields of a request that runs this setting (engine or HTTP body).

        min_steps and max_steps are always sent: a server fills unset ones from its own
        configuration, which would silently change the setting. max_steps = block_size never
        binds (every step accepts at least one token), so it means "no bound" everywhere.
        """
        fields: dict[str, Any] = {
            "block_size": self.block_size,
            "min_steps": 1,
            "max_steps": self.block_size,
        }
        if self.steps is not None:
            fields["steps"] = self.steps
        else:
            fields["threshold"] = self.threshold
        return fields

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (results.json, results.csv)."""
        return {
            "label": self.label,
            "block_size": self.block_size,
            "mode": self.mode,
            "threshold": self.threshold,
            "steps": self.steps,
            "reference": self.reference,
        }


def build_grid(
    block_sizes: Sequence[int], thresholds: Sequence[float], steps: Sequence[int]
) -> tuple[list[DecodeSetting], list[str]]:
    """The settings to measure, reference first within each block size, and notes on what was
    left out (steps values larger than a block size)."""
    settings: list[DecodeSetting] = []
    notes: list[str] = []
    for block in block_sizes:
        settings.append(DecodeSetting(block, steps=block, reference=True))
        settings += [DecodeSetting(block, threshold=t) for t in thresholds]
        for s in steps:
            if s > block:
                notes.append(f"--steps {s} skipped for block size {block} (steps <= block size)")
            elif s != block:  # steps = block size is the reference, already measured
                settings.append(DecodeSetting(block, steps=s))
    return settings, notes


def _items(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise GridError(f"{option} {text!r}: write a comma-separated list such as 4,8,16")
    return items


def _unique(values: list[Any], option: str, text: str) -> None:
    if len(set(values)) != len(values):
        raise GridError(f"{option} {text!r}: a value is listed twice")


def parse_block_sizes(text: str, option: str = "--block-sizes") -> list[int]:
    """`4,8,16` -> [4, 8, 16]: whole numbers >= 1, each once."""
    return _parse_ints(text, option, "block sizes")


def parse_steps(text: str, option: str = "--steps") -> list[int]:
    """`1,2,4` -> [1, 2, 4]: denoising steps per block, whole numbers >= 1, each once."""
    return _parse_ints(text, option, "steps per block")


def _parse_ints(text: str, option: str, what: str) -> list[int]:
    values = []
    for item in _items(text, option):
        if not re.fullmatch(r"\d+", item) or int(item) < 1:
            raise GridError(f"{option} {item!r}: {what} are whole numbers >= 1, e.g. 4,8,16")
        values.append(int(item))
    _unique(values, option, text)
    return values


def parse_thresholds(text: str, option: str = "--thresholds") -> list[float]:
    """`0.5,0.9` -> [0.5, 0.9]: confidence thresholds in (0, 1], each once."""
    values = []
    for item in _items(text, option):
        try:
            value = float(item)
        except ValueError:
            raise GridError(
                f"{option} {item!r}: thresholds are numbers in (0, 1], e.g. 0.5,0.9"
            ) from None
        if not math.isfinite(value) or not 0 < value <= 1:
            raise GridError(f"{option} {item!r}: a threshold must be in (0, 1]")
        values.append(value)
    _unique(values, option, text)
    return values


_LATENCY = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)$")
_LATENCY_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}


def parse_latency(text: str, option: str = "--latency-budget") -> float:
    """`500ms`, `2s`, `1.5s`, `1m` -> seconds (> 0)."""
    match = _LATENCY.match(text.strip())
    if not match or float(match.group(1)) == 0:
        raise GridError(f"{option} {text!r}: write a positive duration like 500ms, 2s or 1m")
    return float(match.group(1)) * _LATENCY_UNITS[match.group(2)]


def parse_quality(text: str, option: str = "--min-quality") -> float:
    """`0.9` -> 0.9: an agreement level in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise GridError(
            f"{option} {text!r}: write an agreement level in (0, 1], e.g. 0.9"
        ) from None
    if not math.isfinite(value) or not 0 < value <= 1:
        raise GridError(f"{option} {text!r}: the agreement level must be in (0, 1]")
    return value
