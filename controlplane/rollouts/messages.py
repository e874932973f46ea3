"""The rollout machine's messages: the record it reads and writes, the observations a round
takes, the commands an operator gives, and the effects it returns for the store to carry out.

Plain frozen data, no behaviour beyond a few names: the contract between the machine
(`controlplane.rollouts.machine`) and the store (`controlplane.rollouts.store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from controlplane.rollouts.progress import RolloutProgress, RolloutSettings
from protocol.gateway import VersionTraffic
from protocol.rollout_states import ACTIVE_STATES, RolloutKind, RolloutPhase, RolloutState
from protocol.rollouts import Analysis, HostStaging

DEFAULT_INTERVAL_S = 300.0


# --- what the machine reads and writes ---------------------------------------------------------


@dataclass(frozen=True)
class RolloutRecord:
    """One record as the machine sees it: the `Rollout` row's fields it owns, and the names its
    events use (`id`, `deployment`, `from_label`, `to_label`: fixed, never written)."""

    id: int
    deployment: str
    kind: RolloutKind
    state: RolloutState
    phase: RolloutPhase
    weights: tuple[int, ...]
    from_label: str = ""
    to_label: str = ""
    new_config: bool = False  # the record brings an engine config of its own
    step_index: int = 0
    canary_weight: int = 0
    canary_instances: int = 0
    failures: int = 0
    step_started_at: datetime | None = None
    paused_left_s: float | None = None
    ticked_at: datetime | None = None
    message: str = ""
    settings: RolloutSettings = field(default_factory=RolloutSettings)
    progress: RolloutProgress = field(default_factory=RolloutProgress)

    @property
    def active(self) -> bool:
        """Progressing or paused: the deployment's one record under way."""
        return self.state in ACTIVE_STATES

    @property
    def interval(self) -> timedelta:
        """How long each step is held."""
        return timedelta(seconds=self.settings.policy.interval_s or DEFAULT_INTERVAL_S)

    @property
    def name(self) -> str:
        """`KIND ID of deployment NAME`, as events say it."""
        return f"{self.kind} {self.id} of deployment {self.deployment}"


@dataclass(frozen=True)
class InstanceSeen:
    """A restart's current instance as the store holds it (None in `Observations`: deleted)."""

    stopped: bool  # its agent reports it stopped (or failed)
    ready: bool  # its agent reports it ready
    held_stopped: bool  # desired stopped by the planner for another reason (a drain)


@dataclass(frozen=True)
class Traffic:
    """The analysis inputs of one window: the stable and the canary version's traffic."""

    stable: VersionTraffic | None = None
    canary: VersionTraffic | None = None


@dataclass(frozen=True)
class Observations:
    """What a round sees of the deployment (`controlplane.rollouts.store.observe`)."""

    own_total: int = 0  # the deployment's own instances (surge ones left out)
    ready: int = 0  # instances serving the record's new version now
    canary_restarts: int = 0  # the new version's instances' restart counters, summed
    staging: tuple[HostStaging, ...] = ()  # per host, while staging
    # An analysis' inputs, when `analysis_windows` asked for them: since the interval began,
    # and since the step's weight took effect.
    interval: Traffic | None = None
    step: Traffic | None = None
    # The model family each version was sized by at registration, read with the analysis
    # inputs (None: not recorded): figures of different families are not compared.
    stable_family: str | None = None
    canary_family: str | None = None
    # The engine kind each pool runs (`engine.kind` of its engine config): figures an engine
    # does not report are not analysed.
    stable_engine: str = "dctl"
    canary_engine: str = "dctl"
    current: InstanceSeen | None = None  # a restart's instance under way


# --- effects: what the store carries out -------------------------------------------------------


@dataclass(frozen=True)
class SetCanary:
    """The canary's instances changed (re-plan the deployment) and/or its weight."""

    instances: int | None = None
    weight: int | None = None


@dataclass(frozen=True)
class StopInstance:
    """Hold a restart's instance stopped (the planner reads which from the record's progress)."""

    instance_id: int


@dataclass(frozen=True)
class StartInstance:
    """Let a restart's instance run again (or, the restart over, every held one)."""

    instance_id: int | None = None


@dataclass(frozen=True)
class StageSnapshot:
    """Tell the deployment's hosts to fetch the new version ahead of time."""


@dataclass(frozen=True)
class SwapStable:
    """The new version (and engine config) becomes stable, the old one the rollback target."""


@dataclass(frozen=True)
class RecordEvent:
    """One event of the audit log about the deployment; `state`: the state the record entered,
    when this is the one event that records the change."""

    kind: str
    message: str
    data: dict[str, object] = field(default_factory=dict)
    state: RolloutState | None = None


@dataclass(frozen=True)
class RecordAnalysis:
    """An interval's analysis, appended to the record's."""

    analysis: Analysis


@dataclass(frozen=True)
class Notify:
    """A notification to the policy's `notify` URL: a state change, or a failed analysis."""

    event: str
    analysis: Analysis | None = None


Effect = (
    SetCanary
    | StopInstance
    | StartInstance
    | StageSnapshot
    | SwapStable
    | RecordEvent
    | RecordAnalysis
    | Notify
)


# --- commands: what an operator asks for -------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """A new record (already checked by the service that made it): its first effects."""

    reason: str = ""


@dataclass(frozen=True)
class Promote:
    """The next step now, or every remaining one (`full`)."""

    full: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Pause:
    """Hold the step where it is."""

    reason: str = ""


@dataclass(frozen=True)
class Resume:
    """Go on with the time the step had left."""

    reason: str = ""


@dataclass(frozen=True)
class Abort:
    """End it: canary weight 0 at once, its instances back on stable."""

    reason: str = ""


@dataclass(frozen=True)
class RollBack:
    """End a canary by going back to `from` (`dctl rollback` during a rollout, or a manual
    canary's end)."""

    reason: str = ""


@dataclass(frozen=True)
class SetManual:
    """A manual canary's weight and instances."""

    weight: int
    instances: int


Command = Start | Promote | Pause | Resume | Abort | RollBack | SetManual


class Refused(Exception):
    """A command that does not apply to the record as it stands (the message says why)."""
