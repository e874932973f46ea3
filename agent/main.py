"""The agent's entry module: one agent process, checked, wired and run (`run`).

`dctl agent` only turns its flags into `AgentSettings` and calls `run(settings)`.

`run` refuses what would fail later with no word why (no control plane, root, an engine
certificate without the advertise address, a data dir it cannot make private), then runs
preflight, serves the agent's own /metrics, wires the supervisor, the snapshot store and the
control-plane link into an `Agent`, and runs it until SIGTERM or SIGINT.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

from agent.control_plane import ControlPlaneLink
from agent.engine_process import HttpMetricsScraper, HttpProber, SubprocessLauncher
from agent.errors import AgentFailure, ControlPlaneRejected, UnusableIdentity
from agent.gpu import BackendSelection, FakeBackend, select_backend
from agent.host_facts import default_host_name, route_address
from agent.instance_spec import SupervisorPolicy
from agent.log_buffer import LogBuffer
from agent.log_shipping import LogShipper
from agent.main_loop import Agent, AgentConfig
from agent.metrics import AgentMetrics
from agent.preflight import PreflightConfig, run_preflight
from agent.private_files import private_dir, write_private
from agent.settings import AgentSettings, SettingsError
from agent.snapshots import SnapshotStore
from agent.supervisor import Supervisor
from protocol.monitoring import metrics_url
from runtime.logs import configure_logging, formatter
from runtime.tls import TlsError, check_name, client_context

log = logging.getLogger("dctl.agent")

EXIT_OK = 0


def run(settings: AgentSettings, *, notices: Sequence[str] = ()) -> int:
    """Run the agent for SETTINGS until SIGTERM/SIGINT (blocking); returns the exit code, 0.

    NOTICES are warnings the caller found (a token passed on the command line), logged once
    logging is set up. Raises `SettingsError` for a setting that cannot be used (a usage error)
    and `AgentFailure` when the agent cannot run. Configures logging itself.
    """
    if not settings.control_plane:
        raise SettingsError(
            "control_plane is required: --control-plane URL, env DCTL_AGENT_CONTROL_PLANE, or "
            "control_plane in the [agent] table of the config file"
        )
    if os.geteuid() == 0 and not settings.allow_root:
        raise AgentFailure(
            "refusing to run as root: run the agent as an ordinary user (engines and snapshots "
            "need no root), or pass --allow-root"
        )
    configure_logging(settings.log_level, settings.log_format)
    token = settings.read_bootstrap_token()
    for warning in settings.check_tls():
        log.warning("%s", warning)
    for notice in notices:
        log.warning("%s", notice)
    runtime = build_agent(settings, settings.control_plane, token, advertise_address(settings))
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal %s: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runtime.run(stop)
    except (ControlPlaneRejected, UnusableIdentity) as exc:
        raise AgentFailure(str(exc)) from exc
    return EXIT_OK


def advertise_address(settings: AgentSettings) -> str:
    """The address engines listen on: the setting, else the local one routing to the control
    plane. Raises `SettingsError` when neither is known."""
    if settings.advertise_address:
        return settings.advertise_address
    assert settings.control_plane is not None
    try:
        return route_address(settings.control_plane)
    except OSError as exc:
        raise SettingsError(
            f"advertise_address: no route to {settings.control_plane} to take it from ({exc}); "
            "pass --advertise-address with the address other machines reach this host at"
        ) from None


def select_gpus(settings: AgentSettings) -> BackendSelection:
    """The GPU backend SETTINGS ask for, with their fake faults injected. Raises `SettingsError`
    when faults are asked of a backend that is not the fake one."""
    selection = select_backend(settings.gpu_backend, settings.fake_gpus)
    if settings.fake_faults:
        if not isinstance(selection.backend, FakeBackend):
            raise SettingsError(
                "fake_faults (--fake-faults): only the fake GPU backend takes faults"
            )
        selection.backend.inject(settings.fake_faults)  # validated with the settings
    return selection


def preflight_config(settings: AgentSettings) -> PreflightConfig:
    """What preflight checks against, from SETTINGS."""
    return PreflightConfig(
        data_dir=settings.data_dir,
        expected_gpus=settings.expected_gpus,
        min_driver_version=settings.min_driver,
    )


def build_agent(
    settings: AgentSettings, control_plane: str, bootstrap_token: str | None, advertise: str
) -> Agent:
    """Check the host (preflight), serve the agent's /metrics and wire an `Agent` for SETTINGS.
    Raises `SettingsError` for an unusable setting, `AgentFailure` when /metrics cannot listen."""
    if control_plane.startswith("http://") and not _loopback(control_plane):
        log.warning(
            "the control plane %s is plain HTTP: the agent token travels in clear; serve it "
            "over HTTPS (dctl server --tls-cert/--tls-key) and use an https:// URL",
            control_plane,
        )
    metrics_tls = _pair(settings.metrics_tls_cert, settings.metrics_tls_key)
    engine_tls = _pair(settings.engine_tls_cert, settings.engine_tls_key)
    if engine_tls is not None:
        # The agent probes engines there, and the gateway reaches them there: a certificate
        # without that name would leave every engine "not ready" with no word why.
        try:
            check_name(*engine_tls, advertise)
        except TlsError as exc:
            raise SettingsError(f"engine_tls_cert (--engine-tls-cert): {exc}") from None
    control_plane_tls = client_context(settings.ca_file)  # checked with the settings
    data_dir = settings.data_dir
    try:
        # Before anything is written there: the token, engine configs and pid files live below.
        private_dir(data_dir)
        private_dir(data_dir / "agent")
    except OSError as exc:
        raise SettingsError(f"data_dir (--data-dir): {exc}") from None
    selection = select_gpus(settings)
    if selection.warning:
        log.warning("%s", selection.warning)
    report = run_preflight(selection, preflight_config(settings))
    for check in report.checks:
        level = {"pass": logging.INFO, "warn": logging.WARNING, "fail": logging.ERROR}
        log.log(level[check.status], "preflight %s: %s: %s", check.name, check.status, check.reason)
    agent_metrics = AgentMetrics()
    host, port = settings.metrics_host, settings.metrics_port
    try:
        bound = agent_metrics.serve(port, host, metrics_tls)
    except OSError as exc:
        raise AgentFailure(
            f"--metrics-port {port} on {host}: {exc.strerror}; pass a free port (0: any)"
        ) from None
    write_private(data_dir / "agent" / "metrics-port", f"{bound}\n")
    # The port actually bound (0 picks one) at an address other machines reach: reported in
    # heartbeats, so the control plane lists it as a scrape target.
    scrape_at = metrics_url("https" if metrics_tls else "http", host, bound, advertise)
    log.info("agent /metrics on %s", scrape_at)
    log.info("engines listen on (and are advertised at) %s", advertise)
    # Engines serve the agent's own certificate: that certificate is all the probes trust.
    engine_trust = client_context(engine_tls[0]) if engine_tls else None
    supervisor = Supervisor(
        data_dir / "agent" / "run",
        SubprocessLauncher(),
        HttpProber(tls=engine_trust),
        policy=SupervisorPolicy(
            startup_grace_s=settings.startup_grace_s,
            log_max_bytes=settings.engine_log_max_bytes,
            log_keep=settings.engine_log_keep,
        ),
    )
    config = AgentConfig(
        control_plane=control_plane,
        data_dir=data_dir,
        bootstrap_token=bootstrap_token,
        host_name=settings.name or default_host_name(),
        advertise_address=advertise,
        labels=settings.labels,
        port_range=settings.ports,
        stop_engines_on_exit=settings.stop_engines_on_exit,
        engine_tls=engine_tls,
        metrics_url=scrape_at,
    )
    return Agent(
        config,
        selection,
        report,
        SnapshotStore(
            data_dir / "snapshots", tls=control_plane_tls, model_roots=settings.model_roots
        ),
        supervisor,
        ControlPlaneLink(control_plane, tls=control_plane_tls),
        metrics=agent_metrics,
        fetch_metrics=HttpMetricsScraper(tls=engine_trust),
        logs=log_shipper(settings, supervisor),
    )


def log_shipper(settings: AgentSettings, supervisor: Supervisor) -> LogShipper | None:
    """What ships SUPERVISOR's engine logs and the agent's own records (None: `ship_logs` off);
    the agent's lines in the format of its stderr."""
    if not settings.ship_logs:
        return None
    shipper = LogShipper(
        supervisor.log_path,
        LogBuffer(settings.log_buffer_lines, settings.log_buffer_bytes),
        cursor_file=settings.data_dir / "agent" / "log-cursors.json",
    )
    shipper.handler.setFormatter(formatter(settings.log_format))
    return shipper


def _pair(cert: Path | None, key: Path | None) -> tuple[str, str] | None:
    """(certificate, key) as paths, or None; `AgentSettings.check_tls` made sure both or none."""
    return (str(cert), str(key)) if cert is not None and key is not None else None


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
