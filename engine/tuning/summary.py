"""What a person reads after a sweep: the table's rows and the recommendation's sentences.

Plain data and strings, no printing: the CLI prints them with its table printer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.tuning.frontier import Criterion
from engine.tuning.report import engine_config_keys
from engine.tuning.scoring import SettingResult

ROLLOUT_CANARY = "10%"

# (header, row key). Narrow enough for an 80-column terminal: the engine's own tokens/forward
# and the mean latency are in results.json / results.csv.
TABLE_COLUMNS = [
    ("", "pick"),
    ("setting", "setting"),
    ("front", "front"),
    ("p50", "p50"),
    ("p95", "p95"),
    ("tok/step", "tpf"),
    ("tok/s", "tps"),
    ("agreement", "agreement"),
    ("held-out", "heldout"),
]
LEGEND = [
    "> recommended   * Pareto front (no setting is both faster and more faithful)",
    "agreement: vs steps=B   held-out: masked-token accuracy   tok/step: tokens per step",
]


def _ratio(value: float | None, digits: int = 3) -> str | None:
    return None if value is None else f"{value:.{digits}f}"


def table_rows(
    results: Sequence[SettingResult], chosen: SettingResult | None
) -> list[dict[str, str | None]]:
    """One row per setting (None: not measured, printed as `-`)."""
    return [
        {
            # A space, not None: an empty cell would print as `-`.
            "pick": ">" if r is chosen else " ",
            "setting": r.setting.label,
            "front": "*" if r.on_front else None,
            "p50": f"{r.p50_s:.3f}s",
            "p95": f"{r.p95_s:.3f}s",
            "tpf": _ratio(r.tokens_per_forward, 2),
            "tps": f"{r.throughput_tps:.1f}",
            "agreement": _ratio(r.agreement),
            "heldout": _ratio(r.heldout_accuracy),
        }
        for r in results
    ]


def recommendation_lines(
    results: Sequence[SettingResult],
    chosen: SettingResult | None,
    criterion: Criterion,
    config_path: Path,
    *,
    model_dir: Path | None,
    deployment: str | None,
    applying: bool = False,
) -> list[str]:
    """The verdict: the recommended setting and how to use it, or why there is none."""
    if chosen is None:
        return [_nothing_meets(results, criterion)]
    why = (
        "the fastest (p50) setting with"
        if criterion.min_quality is not None
        else "the highest agreement with"
    )
    tpf = "" if chosen.tokens_per_forward is None else f", {chosen.tokens_per_forward:.2f} tok/step"
    lines = [
        f"recommended: {chosen.setting.label}, {why} {criterion.describe()}: "
        f"p50 {chosen.p50_s:.3f} s, p95 {chosen.p95_s:.3f} s, agreement {chosen.agreement:.3f}"
        f"{tpf}"
    ]
    if deployment is not None and applying:
        lines.append(f"applying it to {deployment} (--apply): a {ROLLOUT_CANARY} config rollout")
        return lines
    if deployment is not None:
        lines += [
            f"to canary it: run again with --apply (merges these keys into {deployment}'s engine "
            f"config and starts a {ROLLOUT_CANARY} config rollout), or put the keys of "
            f"{config_path} into its engine config file and run",
            f"  dctl rollout {deployment} --engine-config FILE --canary {ROLLOUT_CANARY}",
        ]
        return lines
    flags = " ".join(
        f"--{key.replace('_', '-')} {value}"
        for key, value in engine_config_keys(chosen.setting).items()
    )
    lines.append(f"to serve it: dctl engine serve --model {model_dir} {flags}")
    return lines


def _nothing_meets(results: Sequence[SettingResult], criterion: Criterion) -> str:
    if not results:
        return f"no setting meets {criterion.describe()}: nothing was measured."
    if criterion.min_quality is not None:
        best = max(results, key=lambda r: r.agreement)
        closest = (
            f"the best agreement is {best.agreement:.3f} ({best.setting.label}); lower "
            "--min-quality, or add more careful settings (higher --thresholds, more --steps)"
        )
    else:
        fastest = min(results, key=lambda r: r.p95_s)
        closest = (
            f"the lowest p95 is {fastest.p95_s:.3f} s ({fastest.setting.label}); raise "
            "--latency-budget"
        )
    return f"no setting meets {criterion.describe()}: {closest}. Nothing recommended."
