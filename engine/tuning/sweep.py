"""The sweep: every setting of the grid through one runner, scored against its reference.

The runner is the seam: `InProcessRunner` (a checkpoint loaded here) and `HttpRunner` (a
deployment's engines) both fit, and so does a fake in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any, Protocol

from engine.tuning.grid import DecodeSetting
from engine.tuning.scoring import Batch, SettingResult, Unit, summarise
from runtime.durations import format_duration


class Runner(Protocol):
    """Runs one setting over the whole prompt set."""

    notes: list[str]

    def describe(self) -> dict[str, Any]:
        """The model / endpoint and machine the numbers belong to."""
        ...

    def warm_up(self, setting: DecodeSetting) -> None:
        """One throw-away request before anything is timed."""
        ...

    def run(self, setting: DecodeSetting, *, max_tokens: int, concurrency: int) -> Batch:
        """Every prompt under SETTING; samples in prompt order."""
        ...

    def heldout_accuracy(self, setting: DecodeSetting) -> float | None:
        """Held-out masked-token accuracy of SETTING; None where not measured."""
        ...


Progress = Callable[[str], None]


def run_sweep(
    runner: Runner,
    settings: Sequence[DecodeSetting],
    *,
    max_tokens: int,
    concurrency: int,
    progress: Progress,
    clock: Callable[[], float] = perf_counter,
) -> list[SettingResult]:
    """Measure every setting in order; each block size's reference must come before the rest
    of that block size (`build_grid` orders them so)."""
    references: dict[int, list[Sequence[Unit]]] = {}
    results: list[SettingResult] = []
    if not settings:
        return results
    start = clock()
    warm: set[int] = set()
    for done, setting in enumerate(settings, 1):
        if setting.block_size not in warm:
            # A block size's first forwards pay one-time costs (new shapes, allocations); keep
            # them out of the first setting measured with it, which is its reference.
            runner.warm_up(setting)
            warm.add(setting.block_size)
        batch = runner.run(setting, max_tokens=max_tokens, concurrency=concurrency)
        if setting.reference:
            references[setting.block_size] = [s.units for s in batch.samples]
        reference = references.get(setting.block_size)
        if reference is None:
            raise ValueError(f"{setting.label} comes before the reference of its block size")
        result = summarise(setting, batch, reference, runner.heldout_accuracy(setting))
        results.append(result)
        elapsed = clock() - start
        left = elapsed / done * (len(settings) - done)
        accuracy = (
            "" if result.heldout_accuracy is None else (f", held-out {result.heldout_accuracy:.2f}")
        )
        progress(
            f"[{done}/{len(settings)}] {setting.label:<14} p50 {result.p50_s:.3f} s, "
            f"agreement {result.agreement:.3f}{accuracy} "
            f"({format_duration(elapsed)} elapsed, ~{format_duration(left)} left)"
        )
    return results
