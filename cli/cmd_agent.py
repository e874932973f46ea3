"""`dctl agent`: the per-host agent, its preflight checks and snapshot re-verification.

An adapter: flags -> `agent.settings` (defaults < `[agent]` table of the config file <
`DCTL_AGENT_*` env < these flags; a flag left out here is None and does not override) ->
`agent.main.run`. Everything of `agent` is imported inside the commands, so `dctl --help` stays
light.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from cli.exits import USAGE, fail
from cli.output import JSON_OPTION, print_json, print_table

if TYPE_CHECKING:
    from agent.settings import AgentSettings

agent_app = typer.Typer(
    help="Run the per-host agent (preflight, snapshots, engine supervision). Settings also come "
    "from the [agent] table of the config file and DCTL_AGENT_* env vars; flags win."
)

CONFIG_OPTION = typer.Option(
    None,
    "--config",
    help="Settings file whose [agent] table to read (default: DCTL_CONFIG, else "
    "~/.config/dctl/config.toml).",
)
DATA_DIR_OPTION = typer.Option(
    None, "--data-dir", help="Agent state, snapshots and engine logs (default: the data dir)."
)
BACKEND_OPTION = typer.Option(
    None, "--gpu-backend", help="auto (NVML, fake only without NVIDIA hardware), nvml or fake."
)
FAKE_GPUS_OPTION = typer.Option(
    None, "--fake-gpus", help="Fake GPUs, e.g. 2xH200 (the default), 1xA100,1xL4."
)
FAKE_FAULTS_OPTION = typer.Option(
    None,
    "--fake-faults",
    help="Faults for the fake GPUs: lost:INDEX, ecc:INDEX=COUNT, hot:INDEX=CELSIUS, no-nvml.",
)
EXPECTED_GPUS_OPTION = typer.Option(
    None, "--expected-gpus", help="GPUs this host must have (preflight fails otherwise)."
)
MIN_DRIVER_OPTION = typer.Option(None, "--min-driver", help="Minimum NVIDIA driver [535.0].")


def _settings(config: Path | None, **flags: Any) -> AgentSettings:
    from agent.settings import SettingsError, load_agent_settings

    try:
        return load_agent_settings(config, **flags)
    except SettingsError as exc:
        fail(str(exc), USAGE)


@agent_app.callback(invoke_without_command=True)
def agent(
    ctx: typer.Context,
    config: Path = CONFIG_OPTION,
    control_plane: str = typer.Option(
        None,
        "--control-plane",
        envvar="DCTL_CONTROL_PLANE",
        help="Control-plane URL (also env DCTL_AGENT_CONTROL_PLANE).",
    ),
    bootstrap_token_file: Path = typer.Option(
        None,
        "--bootstrap-token-file",
        help="File (0600) holding the bootstrap token for the first registration.",
    ),
    bootstrap_token: str = typer.Option(
        None,
        "--bootstrap-token",
        envvar="DCTL_BOOTSTRAP_TOKEN",
        help="The bootstrap token itself; prefer --bootstrap-token-file or the env var "
        "(a flag shows in `ps`).",
    ),
    data_dir: Path = DATA_DIR_OPTION,
    gpu_backend: str = BACKEND_OPTION,
    fake_gpus: str = FAKE_GPUS_OPTION,
    fake_faults: str = FAKE_FAULTS_OPTION,
    ports: str = typer.Option(None, "--ports", help="Ports engines may use [18000-18099]."),
    advertise_address: str = typer.Option(
        None,
        "--advertise-address",
        help="Address engines listen on and other machines reach them at (default: the local "
        "address that routes to the control plane).",
    ),
    name: str = typer.Option(None, "--name", help="Host name in the fleet (default: hostname)."),
    label: list[str] = typer.Option([], "--label", help="KEY=VALUE host label (repeatable)."),
    model_root: list[Path] = typer.Option(
        [],
        "--model-root",
        help="Directory local weight sources may be copied from (repeatable; default: none, "
        "every file comes from the control plane).",
    ),
    metrics_port: int = typer.Option(
        None, "--metrics-port", help="Port of the agent's own /metrics (0: any free port) [9401]."
    ),
    metrics_host: str = typer.Option(
        None, "--metrics-host", help="Address of /metrics [127.0.0.1]."
    ),
    ca_file: Path = typer.Option(
        None,
        "--ca-file",
        help="PEM file of the CA that signed the control plane's certificate (default: the "
        "system trust store).",
    ),
    metrics_tls_cert: Path = typer.Option(
        None, "--metrics-tls-cert", help="Serve /metrics over HTTPS with this PEM certificate."
    ),
    metrics_tls_key: Path = typer.Option(
        None, "--metrics-tls-key", help="The key of --metrics-tls-cert."
    ),
    engine_tls_cert: Path = typer.Option(
        None,
        "--engine-tls-cert",
        help="Engines serve HTTPS with this PEM certificate; it must hold the advertise address.",
    ),
    engine_tls_key: Path = typer.Option(
        None, "--engine-tls-key", help="The key of --engine-tls-cert (readable by the engines)."
    ),
    startup_grace_s: float = typer.Option(
        None, "--startup-grace-s", help="How long an engine may take to become ready [600]."
    ),
    expected_gpus: int = EXPECTED_GPUS_OPTION,
    min_driver: str = MIN_DRIVER_OPTION,
    stop_engines_on_exit: bool = typer.Option(
        False,
        "--stop-engines-on-exit",
        help="Drain engines when the agent exits (default: leave them; a restart adopts them).",
    ),
    allow_root: bool = typer.Option(False, "--allow-root", help="Run even as root."),
    log_level: str = typer.Option(None, "--log-level", help="debug, info, warning, error."),
    engine_log_max_bytes: int = typer.Option(
        None, "--engine-log-max-bytes", help="Rotate an engine's log file past this [10 MiB]."
    ),
    engine_log_keep: int = typer.Option(
        None, "--engine-log-keep", help="Rotated engine log files kept [3]."
    ),
    log_buffer_lines: int = typer.Option(
        None,
        "--log-buffer-lines",
        help="Log lines held for the control plane while it is away; more are counted as "
        "dropped [20000].",
    ),
    log_buffer_bytes: int = typer.Option(
        None, "--log-buffer-bytes", help="The same bound in bytes [8 MiB]."
    ),
    no_ship_logs: bool = typer.Option(
        False, "--no-ship-logs", help="Keep engine logs on this host only (no `dctl logs`)."
    ),
) -> None:
    """Run the agent: register with the control plane, heartbeat, supervise engines."""
    if ctx.invoked_subcommand is not None:
        return
    settings = _settings(
        config,
        control_plane=control_plane,
        bootstrap_token=bootstrap_token,
        bootstrap_token_file=bootstrap_token_file,
        data_dir=data_dir,
        gpu_backend=gpu_backend,
        fake_gpus=fake_gpus,
        fake_faults=fake_faults,
        ports=ports,
        advertise_address=advertise_address,
        name=name,
        labels=label or None,
        model_roots=model_root or None,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        ca_file=ca_file,
        metrics_tls_cert=metrics_tls_cert,
        metrics_tls_key=metrics_tls_key,
        engine_tls_cert=engine_tls_cert,
        engine_tls_key=engine_tls_key,
        startup_grace_s=startup_grace_s,
        expected_gpus=expected_gpus,
        min_driver=min_driver,
        # An absent on-switch leaves the file's or env's value alone.
        stop_engines_on_exit=stop_engines_on_exit or None,
        allow_root=allow_root or None,
        log_level=log_level,
        engine_log_max_bytes=engine_log_max_bytes,
        engine_log_keep=engine_log_keep,
        log_buffer_lines=log_buffer_lines,
        log_buffer_bytes=log_buffer_bytes,
        # An absent off-switch leaves the file's or env's value alone.
        ship_logs=False if no_ship_logs else None,
    )
    notices: list[str] = []
    source = ctx.get_parameter_source("bootstrap_token")  # typer vendors click: match by name
    if source is not None and source.name == "COMMANDLINE":
        notices.append(
            "--bootstrap-token on the command line is visible to every user of this host "
            "(ps, /proc): pass --bootstrap-token-file FILE (0600) or env DCTL_BOOTSTRAP_TOKEN"
        )
    from agent.errors import AgentFailure
    from agent.main import run
    from agent.settings import SettingsError

    try:
        code = run(settings, notices=notices)
    except SettingsError as exc:
        fail(str(exc), USAGE)
    except AgentFailure as exc:
        fail(str(exc))
    if code:
        raise typer.Exit(code)


def _gib(value: int | None) -> str | None:
    return None if value is None else f"{value / 2**30:.0f} GiB"


@agent_app.command("preflight")
def preflight(
    json_output: bool = JSON_OPTION,
    config: Path = CONFIG_OPTION,
    data_dir: Path = DATA_DIR_OPTION,
    gpu_backend: str = BACKEND_OPTION,
    fake_gpus: str = FAKE_GPUS_OPTION,
    fake_faults: str = FAKE_FAULTS_OPTION,
    expected_gpus: int = EXPECTED_GPUS_OPTION,
    min_driver: str = MIN_DRIVER_OPTION,
) -> None:
    """Check drivers, GPUs, disk and torch on this host; exit 1 when a check fails."""
    from agent.gpu import na
    from agent.main import preflight_config, select_gpus
    from agent.preflight import run_preflight
    from agent.settings import SettingsError

    settings = _settings(
        config,
        data_dir=data_dir,
        gpu_backend=gpu_backend,
        fake_gpus=fake_gpus,
        fake_faults=fake_faults,
        expected_gpus=expected_gpus,
        min_driver=min_driver,
    )
    try:
        selection = select_gpus(settings)
    except SettingsError as exc:
        fail(str(exc), USAGE)
    report = run_preflight(selection, preflight_config(settings))
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
def verify(
    json_output: bool = JSON_OPTION,
    config: Path = CONFIG_OPTION,
    data_dir: Path = DATA_DIR_OPTION,
) -> None:
    """Re-hash every stored weight snapshot against its manifest; exit 1 on any mismatch."""
    from agent.snapshots import SnapshotStore

    store = SnapshotStore(_settings(config, data_dir=data_dir).data_dir / "snapshots")
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
