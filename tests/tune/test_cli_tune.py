"""`dctl tune MODEL_DIR` end to end on the tiny checkpoint: table, files, exit codes, errors."""

from __future__ import annotations

import csv
import json
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import Result

from protocol.engine_config import ModelTuning
from tests.tune.conftest import PROMPTS, dctl

GRID = ["--block-sizes", "4", "--thresholds", "0.5,0.9", "--steps", "2", "--max-tokens", "8",
        "--heldout-passages", "4", "--threads", "1"]  # fmt: skip
FILES = {"results.json", "results.csv", "quality_latency.png", "recommended-engine-config.yaml"}


def table_rows(stdout: str) -> dict[str, tuple[str, list[str]]]:
    # Columns: mark, SETTING (two words), FRONT, P50, P95, TOK/STEP, TOK/S, AGREEMENT, HELD-OUT.
    rows = {}
    for line in stdout.splitlines():
        if line[3:].startswith("B4 "):
            columns = line[3:].split()
            rows[" ".join(columns[:2])] = (line[0], columns)
    return rows


@dataclass
class Run:
    result: Result
    out: Path

    def rows(self) -> dict[str, tuple[str, list[str]]]:
        """Table rows by setting label: (the recommendation mark, the columns after it)."""
        return table_rows(self.result.stdout)

    def json(self) -> dict:
        return json.loads((self.out / "results.json").read_text())


@pytest.fixture(scope="module")
def run(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One sweep with the default prompt set of the checkpoint (its prompts.txt)."""
    out = tmp_path_factory.mktemp("run") / "out"
    return Run(dctl("tune", str(checkpoint), *GRID, "-o", str(out)), out)


def test_sweep_succeeds_and_writes_every_file_0644(run: Run) -> None:
    assert run.result.exit_code == 0, run.result.stderr
    assert {p.name for p in run.out.iterdir()} == FILES
    for path in run.out.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert (run.out / "quality_latency.png").read_bytes().startswith(b"\x89PNG")


def test_progress_goes_to_stderr_one_line_per_setting(run: Run) -> None:
    lines = [line for line in run.result.stderr.splitlines() if line.startswith("[")]
    assert [line.split()[1] for line in lines] == ["B4", "B4", "B4", "B4"]
    assert lines[-1].startswith("[4/4]")


def test_reference_agrees_with_itself_and_every_setting_is_measured(run: Run) -> None:
    data = run.json()
    by_label = {s["label"]: s for s in data["settings"]}
    assert list(by_label) == ["B4 ref", "B4 t=0.5", "B4 t=0.9", "B4 steps=2"]
    reference = by_label["B4 ref"]
    assert reference["agreement"] == 1.0 and reference["steps"] == 4 and reference["reference"]
    for s in data["settings"]:
        assert s["requests"] == len(PROMPTS)
        assert 0 < s["p50_s"] <= s["p95_s"]
        assert 0 <= s["agreement"] <= 1 and 0 <= s["heldout_accuracy"] <= 1
        assert s["tokens_per_forward"] > 0 and s["throughput_tps"] > 0
    assert data["mode"] == "in-process" and data["model"]["heldout_passages"] > 0


def test_table_marks_the_front_and_the_recommendation(run: Run) -> None:
    data, rows = run.json(), run.rows()
    assert set(rows) == {"B4 ref", "B4 t=0.5", "B4 t=0.9", "B4 steps=2"}
    assert rows["B4 ref"][1][7] == "1.000"
    marked = {label for label, (_, columns) in rows.items() if columns[2] == "*"}
    assert marked == set(data["pareto_front"]) and marked
    recommended = [label for label, (mark, _) in rows.items() if mark == ">"]
    assert recommended == [data["recommendation"]["label"]]
    chosen = next(s for s in data["settings"] if s["label"] == recommended[0])
    assert chosen["agreement"] >= 0.9 and data["criterion"]["min_quality"] == 0.9
    assert f"recommended: {recommended[0]}" in run.result.stdout


def test_csv_and_engine_config_match_the_json(run: Run) -> None:
    data = run.json()
    with (run.out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == [s["label"] for s in data["settings"]]
    assert [r["label"] for r in rows if r["recommended"] == "True"] == [
        data["recommendation"]["label"]
    ]
    config = yaml.safe_load((run.out / "recommended-engine-config.yaml").read_text())
    assert config == data["recommendation"]["engine_config"]
    assert set(config) == {"model"}
    ModelTuning.model_validate(config["model"])  # a deployment's engine config accepts it


def test_a_non_tty_gets_a_note_instead_of_the_terminal_plot(run: Run) -> None:
    assert "terminal plot skipped: stdout is not a terminal" in run.result.stdout


def test_nothing_meeting_the_budget_exits_1_and_still_writes_results(
    checkpoint: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare)
    (bare / "heldout.txt").unlink()
    out = tmp_path / "out"
    result = dctl(
        "tune", str(bare), "--block-sizes", "4", "--thresholds", "0.9", "--max-tokens", "4",
        "--latency-budget", "1ms", "-o", str(out),
    )  # fmt: skip
    assert result.exit_code == 1
    assert "no setting meets p95 latency <= 0.001 s" in result.stdout
    assert "Nothing recommended" in result.stdout
    assert {p.name for p in out.iterdir()} == FILES - {"recommended-engine-config.yaml"}
    assert json.loads((out / "results.json").read_text())["recommendation"] is None
    # No heldout.txt: said once, and the column is empty.
    assert result.stdout.count("has no heldout.txt") == 1
    rows = table_rows(result.stdout)
    assert rows and all(columns[8] == "-" for _, columns in rows.values())
    assert all(mark == " " for mark, _ in rows.values())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "say what to tune"),
        (("{ckpt}", "--deployment", "x"), "not both"),
        (("{ckpt}", "--thresholds", "0.5,2"), "--thresholds '2'"),
        (("{ckpt}", "--block-sizes", "0"), "--block-sizes '0'"),
        (("{ckpt}", "--block-sizes", "4,,8"), "comma-separated"),
        (("{ckpt}", "--min-quality", "0.9", "--latency-budget", "2s"), "not both"),
        (("{ckpt}", "--latency-budget", "soon"), "500ms, 2s or 1m"),
        (("{tmp}",), "not a checkpoint directory"),
        (("{ckpt}", "--prompts", "{tmp}/missing.txt"), "does not exist"),
        (("{ckpt}", "--prompts", "{tmp}/empty.txt"), "is empty"),
        (("{ckpt}", "-o", "{tmp}"), "is not empty"),
        (("--deployment", "x"), "needs --base-url"),
        (("--deployment", "x", "--base-url", "localhost:8800"), "http:// or https://"),
        (("--deployment", "x", "--base-url", "http://h/v1"), "needs an API key"),
        (("{ckpt}", "--base-url", "http://h/v1"), "go with --deployment"),
    ],
)
def test_bad_input_is_a_usage_error_naming_the_fix(
    checkpoint: Path, tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    (tmp_path / "empty.txt").write_text("\n\n")
    argv = [a.format(ckpt=checkpoint, tmp=tmp_path) for a in args]
    result = dctl("tune", *argv, env={"DCTL_API_KEY": ""})
    assert result.exit_code == 2, result.stdout + result.stderr
    assert needle in result.stderr
    assert result.stderr.startswith("error: ")


def test_a_diffusion_gemma_checkpoint_is_refused_before_loading(tmp_path: Path) -> None:
    from engine.families.diffusion_gemma.demo import create_diffusion_gemma_demo

    checkpoint = create_diffusion_gemma_demo(tmp_path / "dg")
    result = dctl("tune", str(checkpoint), *GRID, "-o", str(tmp_path / "out"))
    assert result.exit_code != 0
    assert "the diffusion-gemma family" in result.stderr and "threshold" in result.stderr
    assert not (tmp_path / "out").exists()
