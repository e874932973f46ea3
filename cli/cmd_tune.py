"""`dctl tune`: sweep block-diffusion decoding settings and recommend one.

In-process (`dctl tune MODEL_DIR`) the checkpoint is loaded here; through a deployment
(`dctl tune --deployment NAME --base-url URL`) every request goes to the gateway or an engine.
Progress goes to stderr; the table, the plot and the recommendation to stdout; the results to
files in a new directory. Exit 0 with a recommendation, 1 when no setting meets the criterion
(the results are written all the same), 2 for bad input.
"""

from __future__ import annotations

import os
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import typer

from cli.exits import FAILURE, USAGE, fail

if TYPE_CHECKING:
    from engine.tuning import Criterion, DecodeSetting, Runner, SettingResult
    from engine.tuning.report import SweepRecord

Dtype = Literal["auto", "fp32", "bf16", "fp16"]
API_KEY_ENV = "DCTL_API_KEY"


def register(app: typer.Typer) -> None:
    """Attach this command to the root app."""
    app.command("tune")(tune)


def tune(
    model_dir: Path | None = typer.Argument(
        None, metavar="MODEL_DIR", help="Checkpoint directory to measure in this process."
    ),
    deployment: str | None = typer.Option(
        None, "--deployment", help="Measure this deployment over HTTP instead (needs --base-url)."
    ),
    base_url: str | None = typer.Option(
        None,
        "--base-url",
        help="OpenAI base URL of the gateway or of an engine, e.g. http://127.0.0.1:8800/v1.",
    ),
    api_key_file: Path | None = typer.Option(
        None, "--api-key-file", help=f"File holding the API key (default: ${API_KEY_ENV})."
    ),
    prompts: Path | None = typer.Option(
        None,
        "--prompts",
        help="User messages, one per line (default: MODEL_DIR/prompts.txt, else the demo "
        "model's set).",
    ),
    block_sizes: str = typer.Option("4,8,16,32", "--block-sizes", help="Block sizes to sweep."),
    thresholds: str = typer.Option(
        "0.5,0.7,0.8,0.9,0.95", "--thresholds", help="Threshold-mode settings, each in (0, 1]."
    ),
    steps: str | None = typer.Option(
        None,
        "--steps",
        help="Steps-mode settings: denoising steps per block, e.g. 1,2,4 (default: none; a value "
        "above a block size is skipped for it).",
    ),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Tokens per answer."),
    concurrency: int = typer.Option(
        1, "--concurrency", min=1, help="Requests in flight (1: latency of a lone request)."
    ),
    latency_budget: str | None = typer.Option(
        None,
        "--latency-budget",
        help="Recommend the best agreement with p95 latency within this, e.g. 500ms, 2s, 1m.",
    ),
    min_quality: str | None = typer.Option(
        None,
        "--min-quality",
        help="Recommend the fastest setting with at least this agreement (default 0.9).",
    ),
    heldout: Path | None = typer.Option(
        None, "--heldout", help="Held-out text, paragraphs (default: MODEL_DIR/heldout.txt)."
    ),
    heldout_passages: int | None = typer.Option(
        None, "--heldout-passages", min=0, help="Held-out passages per setting (default 16)."
    ),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="New directory for the results (default ./tune-<UTC time>)."
    ),
    no_plot: bool = typer.Option(False, "--no-plot", help="Do not print the terminal plot."),
    dtype: Dtype | None = typer.Option(
        None, "--dtype", help="In-process weights dtype (default: the checkpoint's)."
    ),
    device: str | None = typer.Option(None, "--device", help="In-process device (default cpu)."),
    threads: int | None = typer.Option(
        None,
        "--threads",
        min=1,
        help="In-process CPU threads, like the engine's resources.threads (default: torch's).",
    ),
    request_timeout: float = typer.Option(
        300.0, "--request-timeout", min=1, help="Seconds one HTTP request may take."
    ),
    apply: bool = typer.Option(
        False,
        "--apply",
        help="With --deployment: canary the recommendation (a config rollout at 10%, the "
        "deployment's rollout policy; needs an operator token in the current context).",
    ),
) -> None:
    """Sweep decoding settings over a prompt set; print the quality-latency table and the
    Pareto front, recommend a setting, and write results, plots and an engine config.

    Quality is the agreement with the one-token-per-step decode of the same block size (and,
    in-process, held-out masked-token accuracy); latency is p50 / p95 per request.
    """
    from engine.tuning import Criterion, GridError, build_grid
    from engine.tuning import grid as g
    from engine.tuning.report import SweepRecord, discard_output_dir, machine_info
    from engine.tuning.workload import WorkloadError

    remote = _mode(model_dir, deployment, base_url, api_key_file, heldout, heldout_passages)
    if apply and not remote:
        fail("--apply rolls the recommendation out to a deployment: give --deployment NAME", USAGE)
    if remote and (dtype is not None or device is not None or threads is not None):
        fail(
            "--dtype, --device and --threads apply in-process only (MODEL_DIR), "
            "not to --deployment",
            USAGE,
        )
    try:
        sizes = g.parse_block_sizes(block_sizes)
        levels = g.parse_thresholds(thresholds)
        step_values = g.parse_steps(steps) if steps is not None else []
        if latency_budget is not None and min_quality is not None:
            fail("give --min-quality or --latency-budget, not both", USAGE)
        criterion = (
            Criterion(latency_budget_s=g.parse_latency(latency_budget))
            if latency_budget is not None
            else Criterion(min_quality=g.parse_quality(min_quality or "0.9"))
        )
    except GridError as exc:
        fail(str(exc), USAGE)
    settings, grid_notes = build_grid(sizes, levels, step_values)
    try:
        prompts_file, messages = _prompt_set(prompts, model_dir)
    except WorkloadError as exc:
        fail(str(exc), USAGE)
    plot_terminal = not no_plot and sys.stdout.isatty()
    _require_plot_packages(terminal=plot_terminal)
    api_key = _api_key(api_key_file) if remote else None
    if apply:
        from cli.tune_apply import check_deployment

        assert deployment is not None
        check_deployment(deployment)  # before minutes of sweeping, not after
    out_dir = output or Path(f"tune-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    created = _prepare_output_dir(out_dir)
    try:
        notes = list(grid_notes)
        if remote:
            assert deployment is not None and base_url is not None and api_key is not None
            runner = _http_runner(base_url, deployment, api_key, messages, request_timeout)
            model: dict[str, Any] = {"name": deployment}
            notes += [
                "held-out accuracy: not measured through a deployment (needs MODEL_DIR)",
                "tok/step: n/a over HTTP (responses carry no denoising steps)",
                "agreement over HTTP compares the words of the answers, not token ids",
            ]
        else:
            assert model_dir is not None
            runner, heldout_note = _local_runner(
                model_dir,
                messages,
                sizes,
                max_tokens=max_tokens,
                concurrency=concurrency,
                heldout=heldout,
                heldout_count=16 if heldout_passages is None else heldout_passages,
                dtype=dtype or "auto",
                device=device or "cpu",
                threads=threads,
            )
            notes += [heldout_note] if heldout_note else []
            model = {"name": model_dir.resolve().name, "path": str(model_dir.resolve())}
        notes += runner.notes
        _progress(
            f"tuning {model['name']} ({'through ' + str(base_url) if remote else 'in-process'}): "
            f"{len(settings)} settings x {len(messages)} prompts from {prompts_file}, "
            f"max {max_tokens} tokens, concurrency {concurrency}"
        )
        results = _sweep(runner, settings, max_tokens, concurrency)
        record = SweepRecord(
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            mode="http" if remote else "in-process",
            model=model | runner.describe(),
            machine=machine_info(),
            options={
                "block_sizes": sizes,
                "thresholds": levels,
                "steps": step_values,
                "max_tokens": max_tokens,
                "concurrency": concurrency,
                "prompts_file": str(prompts_file),
                "prompts": len(messages),
            },
            notes=notes,
        )
        chosen = _report(record, results, criterion, out_dir, plot_terminal, no_plot)
        _print_recommendation(results, chosen, criterion, out_dir, model_dir, deployment, apply)
    except BaseException:
        if created:
            discard_output_dir(out_dir)
        raise
    if chosen is None:
        if apply:
            print("nothing applied: no setting meets the criterion")
        raise typer.Exit(FAILURE)
    if apply:
        assert deployment is not None
        _apply(deployment, chosen, criterion, out_dir)


def _apply(deployment: str, chosen: SettingResult, criterion: Criterion, out_dir: Path) -> None:
    """Start the config rollout of the recommendation and say how to follow it."""
    from cli.rollout_view import started_text
    from cli.tune_apply import apply_recommendation
    from engine.tuning.report import engine_config_keys

    keys = engine_config_keys(chosen.setting)
    started = apply_recommendation(
        deployment, keys, chosen.setting.label, criterion.describe(), out_dir
    )
    if started is None:
        print(f"deployment {deployment} already decodes with {chosen.setting.label}: nothing to do")
        return
    sys.stdout.write(started_text(started))


def _report(
    record: SweepRecord,
    results: list[SettingResult],
    criterion: Criterion,
    out_dir: Path,
    plot_terminal: bool,
    no_plot: bool,
) -> SettingResult | None:
    """Front, recommendation, table, files and plot; returns the recommended result."""
    from engine.tuning import mark_front, recommend

    mark_front(results)
    chosen = recommend(results, criterion)
    _print_table(results, chosen)
    for note in record.notes:
        print(f"note: {note}")
    files = _write_outputs(out_dir, record, results, criterion, chosen)
    _print_plot(results, chosen, plot_terminal, no_plot, out_dir)
    print("wrote " + ", ".join(str(f) for f in files))
    return chosen


def _mode(
    model_dir: Path | None,
    deployment: str | None,
    base_url: str | None,
    api_key_file: Path | None,
    heldout: Path | None,
    heldout_passages: int | None,
) -> bool:
    """True for a deployment over HTTP, False in-process; usage errors for mixed options."""
    if model_dir is not None and deployment is not None:
        fail("give MODEL_DIR or --deployment NAME, not both", USAGE)
    if model_dir is None and deployment is None:
        fail("say what to tune: a checkpoint MODEL_DIR, or --deployment NAME --base-url URL", USAGE)
    if deployment is not None:
        if base_url is None:
            fail(
                "--deployment needs --base-url: the OpenAI base URL of the gateway or an engine, "
                "e.g. http://127.0.0.1:8800/v1",
                USAGE,
            )
        if not base_url.startswith(("http://", "https://")):
            fail(f"--base-url {base_url!r}: write an http:// or https:// URL", USAGE)
        if heldout is not None or heldout_passages is not None:
            fail("held-out accuracy is measured in-process only: drop --heldout*", USAGE)
        return True
    assert model_dir is not None
    if base_url is not None or api_key_file is not None:
        fail("--base-url and --api-key-file go with --deployment, not with MODEL_DIR", USAGE)
    if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
        fail(f"{model_dir} is not a checkpoint directory (no config.json in it)", USAGE)
    return False


def _prompt_set(prompts: Path | None, model_dir: Path | None) -> tuple[Path, list[str]]:
    from engine.tuning.workload import WorkloadError, default_prompts_file, read_prompts

    path = prompts or default_prompts_file(model_dir)
    if path is None:
        raise WorkloadError("no prompt set found; give --prompts FILE (one user message a line)")
    return path, read_prompts(path)


def _require_plot_packages(*, terminal: bool) -> None:
    from engine.tuning.plots import missing_plot_packages

    missing = missing_plot_packages(terminal=terminal)
    if missing:
        fail(
            f"{' and '.join(missing)} not installed (needed for the plots): "
            "pip install 'dctl[tune]'"
        )


def _prepare_output_dir(path: Path) -> bool:
    from engine.tuning.report import ReportError, prepare_output_dir

    try:
        return prepare_output_dir(path)
    except ReportError as exc:
        fail(str(exc), USAGE)


def _api_key(api_key_file: Path | None) -> str:
    """The key from the file, else from the environment; its value is never printed."""
    if api_key_file is not None:
        try:
            key = api_key_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"--api-key-file {api_key_file}: cannot read it ({exc.__class__.__name__})", USAGE)
        if not key:
            fail(f"--api-key-file {api_key_file} is empty", USAGE)
        return key
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key:
        fail(f"--deployment needs an API key: --api-key-file FILE or ${API_KEY_ENV}", USAGE)
    return key


def _http_runner(
    base_url: str, deployment: str, api_key: str, messages: list[str], timeout_s: float
) -> Runner:
    from engine.tuning.remote import HttpRunner

    return HttpRunner(base_url, deployment, api_key, messages, timeout_s=timeout_s)


def _local_runner(
    model_dir: Path,
    messages: list[str],
    sizes: list[int],
    *,
    max_tokens: int,
    concurrency: int,
    heldout: Path | None,
    heldout_count: int,
    dtype: str,
    device: str,
    threads: int | None,
) -> tuple[Runner, str | None]:
    """The loaded checkpoint, and a note when held-out accuracy will not be measured."""
    from engine.errors import EngineError
    from engine.tuning.measure import InProcessRunner
    from engine.tuning.workload import HELDOUT_FILE, WorkloadError, read_paragraphs

    note = None
    heldout_file = heldout or model_dir / HELDOUT_FILE
    if heldout_count == 0:
        note = "held-out accuracy: not measured (--heldout-passages 0)"
    elif heldout is None and not heldout_file.is_file():
        note = f"held-out accuracy: not measured ({model_dir} has no {HELDOUT_FILE})"
    _progress(f"loading {model_dir} ...")
    try:
        paragraphs = None if note else read_paragraphs(heldout_file)
        runner = InProcessRunner.load(
            model_dir,
            messages,
            block_sizes=sizes,
            max_tokens=max_tokens,
            concurrency=concurrency,
            heldout=paragraphs,
            heldout_count=heldout_count,
            dtype=dtype,
            device=device,
            threads=threads,
        )
    except WorkloadError as exc:
        fail(str(exc), USAGE)
    except (EngineError, ValueError) as exc:
        fail(f"cannot load {model_dir}: {exc}")
    return runner, note


def _sweep(
    runner: Runner, settings: list[DecodeSetting], max_tokens: int, concurrency: int
) -> list[SettingResult]:
    from engine.errors import EngineError
    from engine.tuning import run_sweep
    from engine.tuning.remote import RemoteError

    try:
        return run_sweep(
            runner,
            settings,
            max_tokens=max_tokens,
            concurrency=concurrency,
            progress=_progress,
        )
    except (RemoteError, EngineError) as exc:
        fail(str(exc))
    finally:
        close = getattr(runner, "close", None)
        if close is not None:
            close()


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _print_table(results: list[SettingResult], chosen: SettingResult | None) -> None:
    from cli.output import print_table
    from engine.tuning.summary import LEGEND, TABLE_COLUMNS, table_rows

    print_table(table_rows(results, chosen), TABLE_COLUMNS)
    for line in LEGEND:
        print(line)


def _write_outputs(
    out_dir: Path,
    record: SweepRecord,
    results: list[SettingResult],
    criterion: Criterion,
    chosen: SettingResult | None,
) -> list[Path]:
    from engine.tuning.report import ReportError, write_results

    try:
        return write_results(out_dir, record, results, criterion, chosen)
    except ReportError as exc:
        fail(str(exc))


def _print_plot(
    results: list[SettingResult],
    chosen: SettingResult | None,
    plot_terminal: bool,
    no_plot: bool,
    out_dir: Path,
) -> None:
    if no_plot:
        return
    if not plot_terminal:
        print(
            f"(terminal plot skipped: stdout is not a terminal; see {out_dir}/quality_latency.png)"
        )
        return
    from engine.tuning.plots import terminal_plot

    width = min(shutil.get_terminal_size().columns, 110)
    print(terminal_plot(results, chosen, width=width))


def _print_recommendation(
    results: list[SettingResult],
    chosen: SettingResult | None,
    criterion: Criterion,
    out_dir: Path,
    model_dir: Path | None,
    deployment: str | None,
    apply: bool,
) -> None:
    from engine.tuning.report import ENGINE_CONFIG
    from engine.tuning.summary import recommendation_lines

    lines = recommendation_lines(
        results,
        chosen,
        criterion,
        out_dir / ENGINE_CONFIG,
        model_dir=model_dir,
        deployment=deployment,
        applying=apply,
    )
    for line in lines:
        print(line)
