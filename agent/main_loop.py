"""The agent's main loop: register once, heartbeat, reconcile to the desired state.

One thread runs the loop (supervisor ticks every fraction of a second, a heartbeat every
interval); one worker thread fetches snapshots so a long download never stalls probing. When the
control plane is unreachable the loop simply carries on: engines keep running and being
supervised, engine metric deltas keep accumulating, and the next heartbeat that gets through
carries them and picks up whatever desired state changed meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from agent.control_plane import AgentIdentity, ControlPlane, DesiredState, IdentityStore
from agent.engine_metrics import EngineMetricsTracker
from agent.errors import ControlPlaneRejected, ControlPlaneUnavailable, UnusableIdentity
from agent.gpu import BackendSelection, GpuError, GpuSnapshot
from agent.host_facts import default_host_name, gpu_status, host_facts, rss_bytes
from agent.log_shipping import LogShipper
from agent.metrics import AgentMetrics
from agent.preflight import PreflightReport
from agent.reconciler import Reconciler
from agent.snapshot_fetcher import SnapshotFetcher
from agent.snapshots import SnapshotStore
from agent.supervisor import Supervisor
from protocol.plain_text import printable
from protocol.wire import (
    DEFAULT_PORT_RANGE,
    Heartbeat,
    HostFacts,
    InstanceState,
    ObservedInstance,
    RegisterRequest,
    SnapshotFailure,
)

log = logging.getLogger("dctl.agent")
# (engine address, port) -> the engine's /metrics text, None when it did not answer.
# (address, port, path) -> the exposition text, or None.
MetricsFetcher = Callable[[str, int, str], str | None]


@dataclass(frozen=True)
class AgentConfig:
    """How this agent runs."""

    control_plane: str
    data_dir: Path
    bootstrap_token: str | None = field(default=None, repr=False)
    host_name: str = field(default_factory=default_host_name)
    # Where other machines reach this host's engines; None leaves it to the control plane.
    advertise_address: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    tick_s: float = 0.25
    stop_engines_on_exit: bool = False
    # The certificate and key every engine serves HTTPS with; None: engines serve plain HTTP.
    engine_tls: tuple[str, str] | None = None
    # Where the agent's own /metrics answers, as bound (`protocol.monitoring.metrics_url`):
    # reported in the host facts so the control plane can list it as a scrape target.
    metrics_url: str | None = None


class Agent:
    """Registration, heartbeats and reconciliation around a supervisor and a snapshot store."""

    def __init__(
        self,
        config: AgentConfig,
        selection: BackendSelection,
        preflight: PreflightReport,
        store: SnapshotStore,
        supervisor: Supervisor,
        link: ControlPlane,
        metrics: AgentMetrics | None = None,
        fetch_metrics: MetricsFetcher | None = None,
        clock: Callable[[], float] = time.monotonic,
        logs: LogShipper | None = None,
    ) -> None:
        self.config = config
        self.selection = selection
        self.preflight = preflight
        self.store = store
        self.supervisor = supervisor
        self.link = link
        self.metrics = metrics or AgentMetrics()
        self.fetch_metrics = fetch_metrics or (lambda host, port, path: None)
        self.clock = clock
        # Engine and agent log lines for the heartbeats (None: none shipped).
        self.logs = logs
        self._logs_dropped = 0
        self.identities = IdentityStore(config.data_dir / "agent")
        self.identity: AgentIdentity | None = None
        self.interval_s = 5.0
        self.applied_generation = 0
        self.last_reply: DesiredState | None = None
        self.engine_metrics = EngineMetricsTracker()
        self._next_heartbeat = 0.0
        self._outage_since: float | None = None
        self.fetcher = SnapshotFetcher(store, clock)
        backend = selection.backend
        self.reconciler = Reconciler(
            supervisor, store, self.fetcher, preflight,
            # Without a backend preflight has failed and nothing starts: "auto" is never used.
            engine_device=backend.engine_device if backend is not None else "auto",
            control_plane=link.url,
            token=lambda: self.identity.token if self.identity is not None else None,
            engine_tls=config.engine_tls,
        )  # fmt: skip
        self._last_loop_error = ("", 0.0)
        self._last_sample: GpuSnapshot | None = None
        self.metrics.preflight_ok.set(1 if preflight.ok else 0)
        if selection.backend is not None:
            selection.backend.observe_engines(lambda: supervisor.loads(rss_bytes))
        supervisor.on_transition = self._on_transition

    # --- registration ------------------------------------------------------------------------

    def ensure_registered(self) -> AgentIdentity | None:
        """The saved identity, or a new one from the bootstrap token; None while unreachable.

        Raises `UnusableIdentity` when the saved token was issued by another control plane than
        the one this agent talks to: it is never sent anywhere but where it came from.
        """
        if self.identity is None:
            self.identity = self.identities.load(self.link.url)
        if self.identity is not None:
            return self.identity
        if not self.config.bootstrap_token:
            raise ControlPlaneRejected(
                401,
                f"no agent token in {self.identities.directory} and no bootstrap token: "
                "pass --bootstrap-token-file FILE or set DCTL_BOOTSTRAP_TOKEN "
                "(`dctl token create NAME --role bootstrap` makes one)",
            )
        request = RegisterRequest(
            name=self.config.host_name,
            labels=self.config.labels,
            port_range=self.config.port_range,
            facts=self.facts(None),
            advertise_address=self.config.advertise_address,
        )
        try:
            reply = self.link.register(request, self.config.bootstrap_token)
        except ControlPlaneUnavailable as exc:
            log.warning("control plane unreachable, will retry registration: %s", exc)
            return None
        self.identity = AgentIdentity(
            host_id=reply.host_id,
            host_name=reply.host_name,
            control_plane=self.link.url,
            token=reply.agent_token,
        )
        self.identities.save(self.identity)
        self.interval_s = reply.heartbeat_interval_s
        log.info("registered as host %s (id %s)", reply.host_name, reply.host_id)
        return self.identity

    # --- facts and samples -------------------------------------------------------------------

    def sample_gpus(self) -> GpuSnapshot | None:
        """Sample the GPUs; a failing backend is logged and reported as no GPUs."""
        backend = self.selection.backend
        if backend is None:
            return None
        try:
            sample = backend.sample()
        except GpuError as exc:
            log.warning("GPU sample failed: %s", exc)
            return None
        self.metrics.gpus.sample = sample
        self._last_sample = sample
        return sample

    def facts(self, sample: GpuSnapshot | None) -> HostFacts:
        """Slow-changing facts about this host, with the preflight results."""
        failures = [
            SnapshotFailure(digest=p.digest, error=printable(p.error))
            for p in self.fetcher.progress()
            if p.state == "failed"
        ]
        return host_facts(
            self.selection.kind, sample, self.preflight.checks, self.store.root,
            engine_tls=self.config.engine_tls is not None,
            snapshots=self.store.digests(), snapshot_failures=failures,
            metrics_url=self.config.metrics_url,
        )  # fmt: skip

    # --- heartbeat ---------------------------------------------------------------------------

    def heartbeat_once(self) -> DesiredState | None:
        """Send one heartbeat and reconcile to the reply; None when it did not get through."""
        identity = self.ensure_registered()
        if identity is None:
            return None
        sample = self.sample_gpus()
        for instance_id, (host, port, path) in self.supervisor.ready_endpoints().items():
            text = self.fetch_metrics(host, port, path)
            if text is not None:
                self.engine_metrics.record(instance_id, text)
                running = self.engine_metrics.latest_gauge(instance_id, "dllm_requests_running")
                if running is not None:
                    self.supervisor.set_busy(instance_id, min(running / 4.0, 1.0))
        progress = self.fetcher.progress()
        reported_ready = {p.digest for p in progress if p.state == "ready"}
        beat = Heartbeat(
            sent_at=datetime.now(UTC),
            applied_generation=self.applied_generation,
            facts=self.facts(sample),
            advertise_address=self.config.advertise_address,
            gpus=gpu_status(sample) if sample else [],
            instances=self.observed(),
            snapshots=progress[-64:],
            metrics=self.engine_metrics.deltas()[:256],
            logs=self.logs.next_batch() if self.logs is not None else None,
        )
        try:
            reply = self.link.heartbeat(beat, identity.token)
        except ControlPlaneUnavailable as exc:
            self.metrics.heartbeats.labels(result="error").inc()
            if self._outage_since is None:
                self._outage_since = self.clock()
                log.warning("control plane unreachable; engines keep running: %s", exc)
            return None
        except ControlPlaneRejected as exc:
            self.metrics.heartbeats.labels(result="error").inc()
            if exc.status in (401, 404) and self.config.bootstrap_token:
                log.warning("agent token refused (%s); registering again", exc)
                self.identities.clear()
                self.identity = None
            else:
                log.error("heartbeat refused: %s", exc)
                if exc.status in (413, 422) and beat.logs and self.logs is not None:
                    # Perhaps for its log lines: retried, they would refuse every heartbeat.
                    lost = self.logs.discard_in_flight()
                    log.warning("dropped the %d log lines of the refused heartbeat", lost)
            return None
        if self._outage_since is not None:
            log.info(
                "control plane reachable again after %.0f s", self.clock() - self._outage_since
            )
            self._outage_since = None
        self.metrics.heartbeats.labels(result="ok").inc()
        self.engine_metrics.acknowledge()
        if self.logs is not None:
            shipped = Counter(line.source for line in self.logs.acknowledge().lines)
            for source, count in shipped.items():
                self.metrics.log_lines_shipped.labels(source=source).inc(count)
        wanted = {d.model.digest for d in reply.instances} | {r.digest for r in reply.prefetch}
        self.fetcher.reported(reported_ready, wanted)
        self.interval_s = reply.heartbeat_interval_s
        self.last_reply = reply
        self.reconcile(reply)
        self.applied_generation = reply.generation
        return reply

    def observed(self) -> list[ObservedInstance]:
        """Every instance as the next heartbeat reports it."""
        return self.reconciler.observed()

    # --- reconciliation ----------------------------------------------------------------------

    def reconcile(self, reply: DesiredState) -> None:
        """Make the supervisor run what the control plane wants (see `Reconciler`)."""
        for instance_id in self.reconciler.apply(reply, self._last_sample):
            self.engine_metrics.forget(instance_id)
        self.metrics.snapshots_stored.set(len(self.store.digests()))

    def _collect_fetches(self) -> None:
        outcomes = self.fetcher.collect()
        for outcome in outcomes:
            self.metrics.snapshot_fetches.labels(result=outcome.result).inc()
            self.metrics.snapshot_bytes.inc(outcome.bytes)
        if outcomes and self.last_reply is not None:
            self.reconcile(self.last_reply)  # start (or fail) the waiting instances now

    def _on_transition(
        self, instance_id: int, old: InstanceState, new: InstanceState, message: str
    ) -> None:
        self.metrics.engine_transitions.labels(state=new.value).inc()
        if new == InstanceState.STARTING:
            self.metrics.engine_starts.inc()
        if new in (InstanceState.BACKOFF, InstanceState.CRASH_LOOP):
            self.metrics.engine_restarts.inc()
        if new != old and self.identity is not None:
            # Transitions are reported promptly rather than at the next interval.
            self._next_heartbeat = min(self._next_heartbeat, self.clock() + 0.2)

    def _update_instance_gauge(self) -> None:
        counts: dict[str, int] = {state.value: 0 for state in InstanceState}
        for observed in self.observed():
            counts[observed.state.value] += 1
        for state, count in counts.items():
            self.metrics.instances.labels(state=state).set(count)

    # --- the loop ----------------------------------------------------------------------------

    def _collect_logs(self) -> None:
        if self.logs is None:
            return
        self.logs.collect(self.supervisor.instance_ids())
        buffer = self.logs.buffer
        self.metrics.log_lines_dropped.inc(buffer.dropped_total - self._logs_dropped)
        self._logs_dropped = buffer.dropped_total
        self.metrics.log_lines_buffered.set(len(buffer))
        self.metrics.log_bytes_buffered.set(buffer.bytes)

    def step(self) -> None:
        """One pass of the loop: supervise, read logs, collect fetches, heartbeat when due."""
        self.supervisor.tick()
        self._collect_logs()
        self._collect_fetches()
        now = self.clock()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.interval_s
            self.heartbeat_once()
            self._update_instance_gauge()

    def _step_surviving(self) -> None:
        """`step()`, where only an unusable identity stops the agent.

        Anything else that goes wrong in one pass is logged (once a minute while it repeats) and
        the loop goes on: engines keep being supervised and heartbeats keep going out, which is
        worth more than an agent that exits, and exits again after every restart.
        """
        try:
            self.step()
        except (ControlPlaneRejected, UnusableIdentity):
            raise
        except Exception as exc:  # see the docstring
            text, logged_at = self._last_loop_error
            now = self.clock()
            if repr(exc) != text or now - logged_at >= 60.0:
                log.exception("agent loop error; carrying on")
                self._last_loop_error = (repr(exc), now)

    def run(self, stop: threading.Event) -> None:
        """Loop until STOP is set; engines are left running unless configured otherwise.

        While it runs, the agent's own log records (the root logger's) are shipped too.
        """
        if self.logs is None:
            self._run(stop)
            return
        root = logging.getLogger()
        root.addHandler(self.logs.handler)
        try:
            self._run(stop)
        finally:
            root.removeHandler(self.logs.handler)
            self.logs.close()

    def _run(self, stop: threading.Event) -> None:
        adopted = self.supervisor.adopt_existing()
        if adopted:
            log.info("adopted running engine(s) for instance(s) %s", adopted)
        if not self.preflight.ok:
            others = self.preflight.failures("vllm")
            log.error(
                "preflight failed; %s: %s",
                "no engine will start" if others else "only vLLM, SGLang or command engines start",
                "; ".join(f"{c.name}: {c.reason}" for c in self.preflight.failures()),
            )
        try:
            while not stop.is_set():
                self._step_surviving()
                stop.wait(self.config.tick_s)
        finally:
            self.fetcher.shutdown()
            if self.config.stop_engines_on_exit:
                log.info("stopping engines")
                self.supervisor.stop_all()
            else:
                log.info("agent exits; engines keep running and will be adopted on restart")
