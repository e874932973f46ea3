"""`dctl agent`: the per-host agent, its preflight checks and snapshot re-verification.

Everything of `agent` is imported inside the commands, so `dctl --help` stays light.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import USAGE, fail
from cli.output import JSON_OPTION, print_json, print_table

if TYPE_CHECKING:
    from agent.gpu import BackendSelection

agent_app = typer.Typer(help="Run the per-host agent (preflight, snapshots, engine supervision).")

DATA_DIR_OPTION = typer.Option(
    None, "--data-dir", help="Agent state, snapshots and engine logs (default: the data dir)."
)
BACKEND_OPTION = typer.Option(
    "auto", "--gpu-backend", help="auto (NVML, fake only without NVIDIA hardware), nvml or fake."
)
FAKE_GPUS_OPTION = typer.Option(
    "2xH200", "--fake-gpus", help="Fake GPUs, e.g. 2xH200, 1xA100,1xL4."
)
FAKE_FAULTS_OPTION = typer.Option(
    "", "--fake-faults", help="Faults for the fake GPUs: lost:INDEX, ecc:INDEX=COUNT, no-nvml."
)


def _data_dir(value: Path | None) -> Path:
    from protocol import paths

    return (value or paths.data_dir()).expanduser().resolve()


def _select(backend: str, fake_gpus: str, fake_faults: str = "") -> BackendSelection:
    from agent.gpu import FakeBackend, parse_spec, select_backend

    if backend not in ("auto", "nvml", "fake"):
        fail(f"--gpu-backend {backend!r}: choose auto, nvml or fake", USAGE)
    try:
        parse_spec(fake_gpus)
    except ValueError as exc:
        fail(f"--fake-gpus: {exc}", USAGE)
    selection = select_backend(backend, fake_gpus)  # type: ignore[arg-type]
    if fake_faults:
        if not isinstance(selection.backend, FakeBackend):
            fail("--fake-faults: only the fake GPU backend takes injected faults", USAGE)
        try:
            selection.backend.inject(fake_faults)
        except ValueError as exc:
            fail(f"--fake-faults: {exc}", USAGE)
    return selection


def _port_range(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)-(\d+)", text.strip())
    if not match:
        fail(f"--ports {text!r}: write FIRST-LAST, e.g. 18000-18099", USAGE)
    first, last = int(match.group(1)), int(match.group(2))
    if not (1 <= first <= last <= 65535):
        fail(f"--ports {text!r}: ports must be 1-65535 with FIRST <= LAST", USAGE)
    return first, last


def _labels(values: list[str]) -> dict[str, str]:
    labels = {}
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            fail(f"--label {value!r}: write KEY=VALUE", USAGE)
        labels[key] = val
    return labels


def _preflight_config(data_dir: Path, expected_gpus: int | None, min_driver: str) -> Any:
    from agent.preflight import PreflightConfig

    return PreflightConfig(
        data_dir=data_dir, expected_gpus=expected_gpus, min_driver_version=min_driver
    )


@agent_app.callback(invoke_without_command=True)
def agent(
    ctx: typer.Context,
    control_plane: str = typer.Option(
        None, "--control-plane", envvar="DCTL_CONTROL_PLANE", help="Control-plane URL."
    ),
    bootstrap_token: str = typer.Option(
        None,
        "--bootstrap-token",
        envvar="DCTL_BOOTSTRAP_TOKEN",
        help="Bootstrap token for the first registration (env DCTL_BOOTSTRAP_TOKEN).",
    ),
    data_dir: Path = DATA_DIR_OPTION,
    gpu_backend: str = BACKEND_OPTION,
    fake_gpus: str = FAKE_GPUS_OPTION,
    fake_faults: str = FAKE_FAULTS_OPTION,
    ports: str = typer.Option("18000-18099", "--ports", help="Ports engines may use."),
    name: str = typer.Option(None, "--name", help="Host name in the fleet (default: hostname)."),
    label: list[str] = typer.Option([], "--label", help="KEY=VALUE host label (repeatable)."),
    metrics_port: int = typer.Option(
        9401, "--metrics-port", help="Port of the agent's own /metrics (0: any free port)."
    ),
    metrics_host: str = typer.Option("127.0.0.1", "--metrics-host", help="Address of /metrics."),
    startup_grace_s: float = typer.Option(
        600.0, "--startup-grace-s", help="How long an engine may take to become ready."
    ),
    expected_gpus: int = typer.Option(None, "--expected-gpus", help="Fail preflight otherwise."),
    min_driver: str = typer.Option("535.0", "--min-driver", help="Minimum NVIDIA driver."),
    stop_engines_on_exit: bool = typer.Option(
        False,
        "--stop-engines-on-exit",
        help="Drain engines when the agent exits (default: leave them; a restart adopts them).",
    ),
    allow_root: bool = typer.Option(False, "--allow-root", help="Run even as root."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning, error."),
) -> None:
    """Run the agent: register with the control plane, heartbeat, supervise engines."""
    if ctx.invoked_subcommand is not None:
        return
    if not control_plane:
        fail("--control-plane URL is required (or env DCTL_CONTROL_PLANE)", USAGE)
    if os.geteuid() == 0 and not allow_root:
        fail(
            "refusing to run as root: run the agent as an ordinary user (engines and snapshots "
            "need no root), or pass --allow-root"
        )
    from protocol.logs import configure_logging

    configure_logging(log_level, "kv")
    import logging

    # One line per probe and heartbeat would drown what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    _run_agent(
        control_plane=control_plane,
        bootstrap_token=bootstrap_token,
        data_dir=_data_dir(data_dir),
        selection=_select(gpu_backend, fake_gpus, fake_faults),
        port_range=_port_range(ports),
        name=name,
        labels=_labels(label),
        metrics=(metrics_host, metrics_port),
        startup_grace_s=startup_grace_s,
        preflight=_preflight_config(_data_dir(data_dir), expected_gpus, min_driver),
        stop_engines_on_exit=stop_engines_on_exit,
    )


def _run_agent(
    *,
    control_plane: str,
    bootstrap_token: str | None,
    data_dir: Path,
    selection: BackendSelection,
    port_range: tuple[int, int],
    name: str | None,
    labels: dict[str, str],
    metrics: tuple[str, int],
    startup_grace_s: float,
    preflight: Any,
    stop_engines_on_exit: bool,
) -> None:
    import logging

    import httpx

    from agent.control_plane import ControlPlaneClient, ControlPlaneRejected
    from agent.engine_process import HttpProber, SubprocessLauncher
    from agent.host_facts import default_host_name
    from agent.instance_spec import SupervisorPolicy
    from agent.metrics import AgentMetrics
    from agent.preflight import run_preflight
    from agent.runtime import Agent, AgentConfig
    from agent.snapshots import SnapshotStore
    from agent.supervisor import Supervisor

    log = logging.getLogger("dctl.agent")
    if selection.warning:
        log.warning("%s", selection.warning)
    report = run_preflight(selection, preflight)
    for check in report.checks:
        level = {"pass": logging.INFO, "warn": logging.WARNING, "fail": logging.ERROR}
        log.log(level[check.status], "preflight %s: %s: %s", check.name, check.status, check.reason)
    agent_metrics = AgentMetrics()
    host, port = metrics
    try:
        bound = agent_metrics.serve(port, host)
    except OSError as exc:
        fail(f"--metrics-port {port} on {host}: {exc.strerror}; pass a free port (0: any)")
    (data_dir / "agent").mkdir(parents=True, exist_ok=True)
    (data_dir / "agent" / "metrics-port").write_text(f"{bound}\n")
    log.info("agent /metrics on http://%s:%s/metrics", host, bound)
    scraper = httpx.Client(timeout=2.0)

    def fetch_metrics(engine_port: int) -> str | None:
        try:
            response = scraper.get(f"http://127.0.0.1:{engine_port}/metrics")
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    supervisor = Supervisor(
        data_dir / "agent" / "run",
        SubprocessLauncher(),
        HttpProber(),
        policy=SupervisorPolicy(startup_grace_s=startup_grace_s),
    )
    config = AgentConfig(
        control_plane=control_plane,
        data_dir=data_dir,
        bootstrap_token=bootstrap_token,
        host_name=name or default_host_name(),
        labels=labels,
        port_range=port_range,
        stop_engines_on_exit=stop_engines_on_exit,
    )
    runtime = Agent(
        config,
        selection,
        report,
        SnapshotStore(data_dir / "snapshots"),
        supervisor,
        ControlPlaneClient(control_plane),
        metrics=agent_metrics,
        fetch_metrics=fetch_metrics,
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %s: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runtime.run(stop)
    except ControlPlaneRejected as exc:
        fail(str(exc))


def _gib(value: int | None) -> str | None:
    return None if value is None else f"{value / 2**30:.0f} GiB"


@agent_app.command("preflight")
def preflight(
    json_output: bool = JSON_OPTION,
    data_dir: Path = DATA_DIR_OPTION,
    gpu_backend: str = BACKEND_OPTION,
    fake_gpus: str = FAKE_GPUS_OPTION,
    fake_faults: str = FAKE_FAULTS_OPTION,
    expected_gpus: int = typer.Option(None, "--expected-gpus", help="GPUs this host must have."),
    min_driver: str = typer.Option("535.0", "--min-driver", help="Minimum NVIDIA driver."),
) -> None:
    """Check drivers, GPUs, disk and torch on this host; exit 1 when a check fails."""
    from agent.gpu import na
    from agent.preflight import run_preflight

    selection = _select(gpu_backend, fake_gpus, fake_faults)
    report = run_preflight(
        selection, _preflight_config(_data_dir(data_dir), expected_gpus, min_driver)
    )
    sample = None
    if selection.backend is not None:
        from agent.gpu import GpuError

        try:
            sample = selection.backend.sample()
        except GpuError:
            sample = None
    if json_output:
        print_json(
            {
                "ok": report.ok,
                "gpu_backend": selection.kind,
                "checks": [c.model_dump() for c in report.checks],
                "gpus": [
                    {
                        "index": d.index,
                        "name": d.name,
                        "uuid": d.uuid,
                        "health": d.health,
                        "memory_total_bytes": d.memory_total_bytes,
                        "memory_used_bytes": d.memory_used_bytes,
                        "ecc_uncorrected_errors": d.ecc_uncorrected_errors,
                        "persistence_mode": d.persistence_mode,
                        "compute_capability": d.compute_capability,
                    }
                    for d in (sample.devices if sample else ())
                ],
            }
        )
    else:
        if selection.warning:
            print(f"warning: {selection.warning}", file=sys.stderr)
        print_table(
            [c.model_dump() for c in report.checks],
            [("check", "name"), ("status", "status"), ("reason", "reason")],
        )
        if sample:
            print_table(
                [
                    {
                        "index": d.index,
                        "name": d.name,
                        "health": d.health,
                        "memory": na(_gib(d.memory_total_bytes)),
                        "ecc": na(d.ecc_uncorrected_errors),
                        "persistence": na(
                            None
                            if d.persistence_mode is None
                            else ("on" if d.persistence_mode else "off")
                        ),
                        "cc": na(d.compute_capability),
                    }
                    for d in sample.devices
                ],
                [(k, k) for k in ("index", "name", "health", "memory", "ecc", "persistence", "cc")],
            )
    if not report.ok:
        raise typer.Exit(1)


@agent_app.command("verify")
def verify(json_output: bool = JSON_OPTION, data_dir: Path = DATA_DIR_OPTION) -> None:
    """Re-hash every stored weight snapshot against its manifest; exit 1 on any mismatch."""
    from agent.snapshots import SnapshotStore

    store = SnapshotStore(_data_dir(data_dir) / "snapshots")
    results = [store.verify(digest) for digest in store.digests()]
    rows = [{"digest": r.digest, "ok": r.ok, "bad_files": r.bad_files} for r in results]
    if json_output:
        print_json(rows)
    else:
        print_table(rows, [("digest", "digest"), ("ok", "ok"), ("bad files", "bad_files")])
    if not all(r.ok for r in results):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Attach these commands to the root app."""
    app.add_typer(agent_app, name="agent")
