"""One supervised instance: the record the supervisor keeps per engine, and what it reports.

The supervisor (`agent.supervisor`) decides every state change; this module only holds the
record and turns it into the shapes others read: the heartbeat's `ObservedInstance`, the fake
GPUs' `EngineLoad`, the pid file's `PidRecord`, and the `ExitInfo` of an engine that ended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from agent.backends.launch import Probes
from agent.engine_process import EngineProcess, PidRecord, log_tail
from agent.gpu import EngineLoad
from agent.instance_spec import InstanceSpec
from protocol.plain_text import printable
from protocol.wire import ExitInfo, InstanceState, ObservedInstance


@dataclass
class SupervisedInstance:
    """What the supervisor knows about one instance: its spec, state, process and timers."""

    spec: InstanceSpec
    state: InstanceState = InstanceState.PENDING
    process: EngineProcess | None = None
    started_at: float = 0.0
    ready_since: float | None = None
    restart_count: int = 0
    failures: int = 0
    next_start_at: float = 0.0
    next_probe_at: float = 0.0
    probe_failures: int = 0
    stop_deadline: float | None = None
    killed: bool = False
    after_stop: str = "stay"  # "stay" stopped, "restart" after a failure, "remove" forget it
    last_exit: ExitInfo | None = None
    message: str = ""
    note: str = ""  # said by the agent about this instance (e.g. its new snapshot was refused)
    busy_ratio: float = 0.0
    probes: Probes = field(default_factory=Probes)  # where its engine kind is probed and scraped

    def observed(self) -> ObservedInstance:
        """This instance as the heartbeat reports it."""
        return ObservedInstance(
            instance_id=self.spec.instance_id,
            state=self.state,
            pid=self.process.pid if self.process is not None else None,
            port=self.spec.port,
            restart_count=self.restart_count,
            last_exit=self.last_exit,
            version_digest=self.spec.digest,
            # Messages quote exceptions and engine logs (line breaks, colours): the control plane
            # refuses control characters, so they leave here printable.
            message=printable("; ".join(m for m in (self.message, self.note) if m))[:1000],
        )

    def engine_load(self, memory_bytes: Callable[[int], int] | None) -> EngineLoad | None:
        """What the running engine holds, for the fake GPU backend (None when none runs)."""
        if self.process is None:
            return None
        held = memory_bytes(self.process.pid) if memory_bytes else 0
        return EngineLoad(
            pid=self.process.pid,
            device_indices=self.spec.gpu_indices or (0,),
            memory_bytes=held,
            busy_ratio=self.busy_ratio,
        )

    def pid_record(self, config_path: Path) -> PidRecord:
        """What a later agent needs to adopt the running engine."""
        assert self.process is not None
        return PidRecord(
            instance_id=self.spec.instance_id,
            pid=self.process.pid,
            port=self.spec.port,
            config_path=str(config_path),
            fingerprint=self.spec.fingerprint(),
            spec=self.spec.record(),
            restart_count=self.restart_count,
        )


def exit_info(log_path: Path, code: int | None, reason: str) -> ExitInfo:
    """How an engine ended; CODE < 0 is a signal, -1 an adopted process of unknown fate."""
    # Only an engine that exited on its own has last words worth reporting.
    tail = log_tail(log_path) if code and code > 0 else ""
    text = reason if not tail else f"{reason}; log: {tail}"
    return ExitInfo(
        code=code if code is not None and code >= 0 else None,
        signal=-code if code is not None and code < -1 else None,
        reason=printable(text)[:1000],
        at=datetime.now(UTC),
    )
