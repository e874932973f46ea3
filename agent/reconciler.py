"""From a desired state to engines: what the supervisor runs, what gets fetched, what is reported.

`Reconciler.apply()` takes one heartbeat reply and, instance by instance, stops, starts, fetches
for or refuses it; `observed()` is what the next heartbeat reports. A desired state comes from the
network: whatever one instance of it holds, the worst it does is get that instance refused
(`failed`, with the reason; an engine already running it keeps serving). It never stops the
agent or touches the other instances.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from agent.admission import memory_shortfall, refusal, reportable
from agent.control_plane import DesiredState, files_url_on
from agent.cpu_threads import threads_per_instance, usable_cores
from agent.errors import ForeignUrl
from agent.gpu import GpuSnapshot
from agent.instance_spec import InstanceSpec
from agent.preflight import PreflightReport
from agent.snapshot_fetcher import SnapshotFetcher
from agent.snapshots import SnapshotStore
from agent.supervisor import Supervisor
from protocol.engine_kinds import engine_kind
from protocol.plain_text import printable
from protocol.version_ref import VersionRef
from protocol.wire import (
    DesiredInstance,
    DesiredInstanceState,
    InstanceState,
    ModelVersionRef,
    ObservedInstance,
)

log = logging.getLogger("dctl.agent")


class Reconciler:
    """Applies desired states to a supervisor and a snapshot fetcher; see the module docstring.

    CONTROL_PLANE is the URL the agent token belongs to (snapshot files are fetched only from
    there); TOKEN gives the current agent token (it changes when the agent registers again).
    ENGINE_TLS, the agent's engine certificate and key, goes into every instance's spec.
    """

    def __init__(
        self,
        supervisor: Supervisor,
        store: SnapshotStore,
        fetcher: SnapshotFetcher,
        preflight: PreflightReport,
        engine_device: str,
        control_plane: str,
        token: Callable[[], str | None],
        engine_tls: tuple[str, str] | None = None,
    ) -> None:
        self.supervisor, self.store, self.fetcher = supervisor, store, fetcher
        self.preflight = preflight
        self.engine_device = engine_device
        self.control_plane = control_plane
        self.token = token
        self.engine_tls = engine_tls
        # What to report for instances the supervisor does not run as desired (yet): snapshot
        # downloads, and refusals (a desired state that could not be read or applied).
        self._waiting: dict[int, tuple[InstanceState, str]] = {}
        self._sample: GpuSnapshot | None = None
        # CPU threads for each engine whose config sets none: the cores shared by every instance
        # placed on this host (held stopped ones too, so a restart does not change the figure).
        self._threads: int | None = None

    def apply(self, reply: DesiredState, sample: GpuSnapshot | None) -> list[int]:
        """Make the supervisor run what REPLY wants; returns the instances no longer wanted.

        SAMPLE is the latest GPU sample (None: unknown), to check GPU indices and memory.
        """
        self._sample = sample
        self._threads = threads_per_instance(usable_cores(), len(reply.instances))
        wanted = {d.instance_id for d in reply.instances} | set(reply.unreadable)
        for instance_id, reason in reply.unreadable.items():
            self._refuse(instance_id, reason)
        for desired in reply.instances:
            if not reportable(desired.instance_id):
                log.error("desired instance %s ignored: no heartbeat can report that id",
                          desired.instance_id)  # fmt: skip
                continue
            try:
                self._apply(desired)
            except Exception as exc:  # whatever is wrong with one instance, the rest go on
                log.exception("instance %s: cannot apply its desired state", desired.instance_id)
                self._refuse(desired.instance_id, f"cannot apply: {type(exc).__name__}: {exc}")
        removed = [i for i in self.supervisor.instance_ids() if i not in wanted]
        for instance_id in removed:
            self.supervisor.stop(instance_id, remove=True)
        for instance_id in [i for i in self._waiting if i not in wanted]:
            del self._waiting[instance_id]
        for ref in reply.prefetch:
            self._prefetch(ref)
        in_use = {d.model.digest for d in reply.instances} | set(reply.keep_digests)
        in_use |= {r.digest for r in reply.prefetch}
        for instance_id in self.supervisor.instance_ids():
            running = self.supervisor.spec_of(instance_id)
            if running is not None:
                in_use.add(running.digest)
        for digest in self.store.prune(in_use):
            log.info("snapshot %s pruned (keeping the last %s)", digest[:12], self.store.keep)
        return removed

    def observed(self) -> list[ObservedInstance]:
        """Supervised instances plus those waiting for their snapshot or refused."""
        observed = {o.instance_id: o for o in self.supervisor.observed()}
        for instance_id, (state, said) in self._waiting.items():
            message = printable(said)  # it may quote an exception: printable for the wire
            current = observed.get(instance_id)
            if current is None or current.state in (InstanceState.FAILED, InstanceState.STOPPED):
                observed[instance_id] = ObservedInstance(
                    instance_id=instance_id, state=state, message=message[:1000]
                )
            else:  # the old engine keeps serving; say what is happening to the new one
                note = f"{current.message}; {message}".strip("; ")
                observed[instance_id] = current.model_copy(update={"message": note[:1000]})
        return [observed[i] for i in sorted(observed)]

    def _apply(self, desired: DesiredInstance) -> None:
        """Stop, start, fetch for or refuse one desired instance."""
        instance_id = desired.instance_id
        if desired.desired_state == DesiredInstanceState.STOPPED:
            self._waiting.pop(instance_id, None)
            self.supervisor.stop(instance_id)
            return
        failed = self.preflight.failures(engine_kind(desired.engine_config))
        if failed:
            reasons = "; ".join(f"{c.name}: {c.reason}" for c in failed)
            spec = self._spec(desired, Path())
            self.supervisor.mark_failed(instance_id, spec, f"preflight failed: {reasons}")
            return
        host_gpus = None if self._sample is None else [d.index for d in self._sample.devices]
        why_not = refusal(desired, host_gpus)
        if why_not is not None:
            self._refuse(instance_id, why_not)
            return
        digest = desired.model.digest
        if self.store.has(digest):
            self._waiting.pop(instance_id, None)
            spec = self._spec(desired, self.store.path_for(digest))
            idle = self.supervisor.state_of(instance_id) in (
                None, InstanceState.FAILED, InstanceState.STOPPED)  # fmt: skip
            short = memory_shortfall(desired, self._sample) if idle else None
            if short is not None:
                self.supervisor.mark_failed(instance_id, spec, short)
            else:
                self.supervisor.ensure(spec)
            return
        fetch_refused = self.fetcher.refusal(digest)
        if fetch_refused is not None:
            self._waiting.pop(instance_id, None)
            self.supervisor.mark_failed(instance_id, self._spec(desired, Path()), fetch_refused)
            return
        try:
            self._start_fetch(desired)
        except ForeignUrl as exc:
            self._refuse(instance_id, f"snapshot not fetched: {exc}")
            return
        self._waiting[instance_id] = (
            InstanceState.DOWNLOADING,
            f"fetching snapshot {VersionRef(desired.model.name, desired.model.version)} "
            f"({digest[:12]})",
        )

    def _refuse(self, instance_id: int, reason: str) -> None:
        """Report an instance `failed` with REASON; an engine already running it keeps serving."""
        if self._waiting.get(instance_id) != (InstanceState.FAILED, reason):
            log.error("instance %s refused: %s", instance_id, reason)  # once, not every beat
        self._waiting[instance_id] = (InstanceState.FAILED, reason)

    def _spec(self, desired: DesiredInstance, snapshot: Path) -> InstanceSpec:
        gpus = tuple(desired.gpu_indices)
        engine = desired.engine_config.get("engine") if desired.engine_config else None
        if not gpus and isinstance(engine, dict) and engine.get("kind", "dctl") != "dctl":
            # "Every GPU of the host", spelled out: another engine's tensor parallel size
            # (and a command's {gpus}) is the count. The dctl engine counts them itself.
            gpus = tuple(d.index for d in self._sample.devices) if self._sample else ()
        return InstanceSpec(
            instance_id=desired.instance_id,
            deployment=desired.deployment,
            digest=desired.model.digest,
            snapshot_path=str(snapshot),
            port=desired.port,
            gpu_indices=gpus,
            engine_config=desired.engine_config,
            device=self.engine_device,
            bind_address=desired.bind_address,
            api_key=desired.api_key,
            tls_cert=self.engine_tls[0] if self.engine_tls else None,
            tls_key=self.engine_tls[1] if self.engine_tls else None,
            threads=self._threads,
        )

    def _prefetch(self, ref: ModelVersionRef) -> None:
        """Fetch and verify a snapshot no instance runs yet (a rollout's pre-staging)."""
        if self.store.has(ref.digest) or self.fetcher.refusal(ref.digest) is not None:
            return
        try:
            self._fetch(ref)
        except ForeignUrl as exc:
            log.error("snapshot %s not pre-staged: %s", ref.digest[:12], exc)

    def _start_fetch(self, desired: DesiredInstance) -> None:
        """Queue the snapshot's fetch of a desired instance's version."""
        self._fetch(desired.model)

    def _fetch(self, model: ModelVersionRef) -> None:
        """Queue a snapshot's fetch; raises `ForeignUrl` for a files_url off the control plane.

        The agent token goes only to the control plane it was issued by, so a files_url is
        resolved against the configured control-plane URL and checked before any request.
        """
        files_url = model.files_url
        if files_url:
            files_url = files_url_on(self.control_plane, files_url)
        token = self.token()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.fetcher.start(model, files_url, headers)
