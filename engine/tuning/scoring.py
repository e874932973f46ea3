"""From raw requests to one setting's numbers: latency percentiles, speed and quality."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.tuning.grid import DecodeSetting

# What agreement compares, position by position: token ids in-process; over HTTP only the
# text comes back, so its whitespace-separated words.
Unit = int | str


@dataclass(frozen=True)
class RequestSample:
    """One request of a setting, as measured."""

    e2e_s: float
    completion_tokens: int
    units: Sequence[Unit]  # token ids (in-process) or words (HTTP), compared for agreement
    denoise_steps: int | None = None  # sum of steps_per_block; None where not reported
    engine_tokens_per_forward: float | None = None  # the engine's own RequestStats figure


@dataclass(frozen=True)
class Batch:
    """All prompts of one setting: the samples in prompt order and the wall time they took."""

    samples: list[RequestSample]
    wall_s: float


@dataclass
class SettingResult:
    """Everything measured for one setting; `None` means not measured (printed as `-`)."""

    setting: DecodeSetting
    requests: int
    p50_s: float
    p95_s: float
    mean_s: float
    completion_tokens: int
    throughput_tps: float
    tokens_per_forward: float | None
    engine_tokens_per_forward: float | None
    agreement: float
    heldout_accuracy: float | None = None
    wall_s: float = 0.0
    on_front: bool = False
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields: the setting's, then every metric."""
        return {
            **self.setting.as_dict(),
            "requests": self.requests,
            "p50_s": self.p50_s,
            "p95_s": self.p95_s,
            "mean_s": self.mean_s,
            "completion_tokens": self.completion_tokens,
            "throughput_tps": self.throughput_tps,
            "tokens_per_forward": self.tokens_per_forward,
            "engine_tokens_per_forward": self.engine_tokens_per_forward,
            "agreement": self.agreement,
            "heldout_accuracy": self.heldout_accuracy,
            "wall_s": self.wall_s,
            "on_front": self.on_front,
        }


def agreement(reference: Sequence[Unit], output: Sequence[Unit]) -> float:
    """Fraction of positions where OUTPUT matches REFERENCE, over the longer of the two.

    Positions past the shorter one count as mismatches (an early stop or a longer answer is a
    difference); two empty outputs agree fully.
    """
    longest = max(len(reference), len(output))
    if longest == 0:
        return 1.0
    same = sum(a == b for a, b in zip(reference, output, strict=False))
    return same / longest


def mean_agreement(
    references: Sequence[Sequence[Unit]], outputs: Sequence[Sequence[Unit]]
) -> float:
    """Per-prompt agreement averaged over the prompts (paired in order)."""
    if len(references) != len(outputs):
        raise ValueError(f"{len(outputs)} outputs for {len(references)} reference outputs")
    if not references:
        return 1.0
    return statistics.fmean(agreement(r, o) for r, o in zip(references, outputs, strict=True))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(
    setting: DecodeSetting,
    batch: Batch,
    reference: Sequence[Sequence[Unit]],
    heldout_accuracy: float | None = None,
) -> SettingResult:
    """One setting's row: latency over its requests, speed, and agreement with REFERENCE."""
    samples = batch.samples
    latencies = [s.e2e_s for s in samples]
    tokens = sum(s.completion_tokens for s in samples)
    steps = [s.denoise_steps for s in samples]
    total_steps = None if any(n is None for n in steps) else sum(n or 0 for n in steps)
    engine_tpf = [s.engine_tokens_per_forward for s in samples]
    return SettingResult(
        setting=setting,
        requests=len(samples),
        p50_s=percentile(latencies, 50),
        p95_s=percentile(latencies, 95),
        mean_s=statistics.fmean(latencies) if latencies else math.nan,
        completion_tokens=tokens,
        throughput_tps=tokens / batch.wall_s if batch.wall_s > 0 else 0.0,
        tokens_per_forward=tokens / total_steps if total_steps else None,
        engine_tokens_per_forward=(
            None
            if not engine_tpf or any(v is None for v in engine_tpf)
            else statistics.fmean(v or 0.0 for v in engine_tpf)
        ),
        agreement=mean_agreement(reference, [s.units for s in samples]),
        heldout_accuracy=heldout_accuracy,
        wall_s=batch.wall_s,
    )
