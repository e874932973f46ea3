"""`dctl tune`: the quality-latency curve of block-diffusion decoding settings.

A sweep runs every setting of a grid (block size x threshold or steps) over a prompt set, in this
process (`InProcessRunner`) or through a deployment (`HttpRunner`), scores each against the
one-token-per-step decode of its block size, finds the Pareto front and recommends a setting.

Torch-free names are imported at once; the runners load on first use (PEP 562), so the grid,
the scoring and the recommendation rules import without torch or httpx.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.tuning.frontier import Criterion, mark_front, pareto_front, recommend
from engine.tuning.grid import (
    DecodeSetting,
    GridError,
    build_grid,
    parse_block_sizes,
    parse_latency,
    parse_quality,
    parse_steps,
    parse_thresholds,
)
from engine.tuning.scoring import Batch, RequestSample, SettingResult, agreement, summarise
from engine.tuning.sweep import Runner, run_sweep

_LAZY: dict[str, str] = {
    "InProcessRunner": "engine.tuning.measure",
    "HttpRunner": "engine.tuning.remote",
    "RemoteError": "engine.tuning.remote",
}

if TYPE_CHECKING:
    from engine.tuning.measure import InProcessRunner
    from engine.tuning.remote import HttpRunner, RemoteError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine.tuning' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "Batch",
    "Criterion",
    "DecodeSetting",
    "GridError",
    "HttpRunner",
    "InProcessRunner",
    "RemoteError",
    "RequestSample",
    "Runner",
    "SettingResult",
    "agreement",
    "build_grid",
    "mark_front",
    "pareto_front",
    "parse_block_sizes",
    "parse_latency",
    "parse_quality",
    "parse_steps",
    "parse_thresholds",
    "recommend",
    "run_sweep",
    "summarise",
]
