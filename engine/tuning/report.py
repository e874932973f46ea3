"""What a sweep leaves behind: the output directory, results.json / results.csv, and the
recommended engine config.

Files are created new (never overwritten) with mode 0644 inside a directory the sweep makes or
finds empty, so results of two runs are never mixed.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.tuning.frontier import Criterion
from engine.tuning.grid import DecodeSetting
from engine.tuning.scoring import SettingResult
from protocol.engine_config import ModelTuning

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
PLOT_PNG = "quality_latency.png"
ENGINE_CONFIG = "recommended-engine-config.yaml"
FILE_MODE = 0o644


class ReportError(ValueError):
    """An output directory or file that cannot be written; the message names it."""


def prepare_output_dir(path: Path) -> bool:
    """Create PATH (parents too), or accept it when it is an empty directory; True when it
    was created here. Done before a sweep, so a bad -o fails in seconds, not after it."""
    if path.exists():
        if not path.is_dir():
            raise ReportError(f"output {path} exists and is not a directory; choose another -o")
        if any(path.iterdir()):
            raise ReportError(
                f"output directory {path} is not empty; choose a new -o DIR so that results "
                "of different runs are not mixed"
            )
        return False
    try:
        path.mkdir(parents=True, mode=0o755)
    except OSError as exc:
        raise ReportError(f"cannot create output directory {path}: {exc.strerror}") from None
    return True


def discard_output_dir(path: Path) -> None:
    """Remove PATH if it is still empty (a sweep that failed leaves no empty directory)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def write_file(path: Path, data: bytes) -> Path:
    """Write a new file with mode 0644 whatever the umask; an existing file is an error."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        raise ReportError(f"{path} already exists; not overwriting it") from None
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), FILE_MODE)
        out.write(data)
    return path


def engine_config_keys(setting: DecodeSetting) -> dict[str, Any]:
    """The `model:` keys of an engine config that decode like SETTING."""
    if setting.steps is None:
        keys = {
            "block_size": setting.block_size,
            "threshold": setting.threshold,
            "min_steps": 1,
            "max_steps": setting.block_size,
        }
    else:
        # `model.steps` makes steps mode the default for requests that choose no mode.
        keys = {
            "block_size": setting.block_size,
            "steps": setting.steps,
            "min_steps": 1,
            "max_steps": setting.block_size,
        }
    ModelTuning.model_validate(keys)  # what a deployment's engine config would refuse, we refuse
    return keys


def engine_config_yaml(result: SettingResult, criterion: Criterion, model: str) -> str:
    """The recommended engine config: only the `model:` decoding keys, with why in comments."""
    import yaml

    setting = result.setting
    lines = [
        f"# dctl tune: recommended decoding settings for {model} ({setting.label})",
        f"# criterion: {criterion.describe()}; measured p50 {result.p50_s:.3f} s, "
        f"p95 {result.p95_s:.3f} s, agreement {result.agreement:.3f}",
    ]
    body = yaml.safe_dump({"model": engine_config_keys(setting)}, sort_keys=False)
    return "\n".join(lines) + "\n" + body


CSV_FIELDS = [
    "label",
    "block_size",
    "mode",
    "threshold",
    "steps",
    "reference",
    "requests",
    "p50_s",
    "p95_s",
    "mean_s",
    "completion_tokens",
    "throughput_tps",
    "tokens_per_forward",
    "engine_tokens_per_forward",
    "agreement",
    "heldout_accuracy",
    "wall_s",
    "on_front",
    "recommended",
]


def results_csv(results: Sequence[SettingResult], recommended: SettingResult | None) -> str:
    """One row per setting; empty cells where a metric was not measured."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in results:
        row = {**r.as_dict(), "recommended": r is recommended}
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_FIELDS})
    return buffer.getvalue()


@dataclass(frozen=True)
class SweepRecord:
    """Everything results.json holds besides the per-setting rows."""

    created_at: str
    mode: str  # "in-process" | "http"
    model: dict[str, Any]
    machine: dict[str, Any]
    options: dict[str, Any]
    notes: list[str]


def results_json(
    record: SweepRecord,
    results: Sequence[SettingResult],
    criterion: Criterion,
    recommended: SettingResult | None,
) -> str:
    """The whole sweep as JSON: what was measured where, every metric, the recommendation."""
    data = {
        "tool": "dctl tune",
        "created_at": record.created_at,
        "mode": record.mode,
        "model": record.model,
        "machine": record.machine,
        "options": record.options,
        "notes": record.notes,
        "criterion": criterion.as_dict(),
        "settings": [r.as_dict() for r in results],
        "pareto_front": [r.setting.label for r in results if r.on_front],
        "recommendation": None
        if recommended is None
        else {
            "label": recommended.setting.label,
            "setting": recommended.setting.as_dict(),
            "engine_config": {"model": engine_config_keys(recommended.setting)},
        },
    }
    return json.dumps(data, indent=2) + "\n"


def machine_info() -> dict[str, Any]:
    """The machine the sweep ran on (the client's, through a deployment)."""
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


def write_results(
    out_dir: Path,
    record: SweepRecord,
    results: Sequence[SettingResult],
    criterion: Criterion,
    recommended: SettingResult | None,
) -> list[Path]:
    """Write results.json, results.csv, the PNG and (with a recommendation) the engine config;
    returns their paths."""
    from engine.tuning.plots import quality_latency_png

    model = str(record.model.get("name", "model"))
    files = [
        write_file(
            out_dir / RESULTS_JSON,
            results_json(record, results, criterion, recommended).encode(),
        ),
        write_file(out_dir / RESULTS_CSV, results_csv(results, recommended).encode()),
        write_file(
            out_dir / PLOT_PNG, quality_latency_png(results, recommended, f"dctl tune: {model}")
        ),
    ]
    if recommended is not None:
        config = engine_config_yaml(recommended, criterion, model)
        files.append(write_file(out_dir / ENGINE_CONFIG, config.encode()))
    return files
