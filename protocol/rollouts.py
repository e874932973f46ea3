"""Contracts of rollouts, rollbacks and restarts (`/api/v1/deployments/{name}/rollout...`).

A rollout moves a deployment to a new (version, engine config) pair through canary steps of
rising weight, each analysed against the stable pool; a rollback moves it back to a version its
hosts still hold, with no analysis; a restart replaces its engine processes one at a time. All
three are `RolloutOut` records of one kind each, and a deployment has at most one active.
"""

from __future__ import annotations

from datetime import datetime
from itertools import pairwise
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from protocol.rest import ApiModel, _check_engine_config
from protocol.rollout_policy import RolloutPolicy
from protocol.rollout_states import (
    RolloutKind,
    RolloutPhase,
    RolloutState,
)
from protocol.wire import INT32_MAX, PlainText

# An interval's verdict, and each metric's. `starved`: the canary served far less than its
# weight (`controlplane.rollouts.analysis.is_starved`), so its figures cannot be judged.
# "n/a": a figure the version's engine does not report (vLLM has no denoising steps): not
# analysed, so it neither passes nor holds the step back.
Verdict = Literal["pass", "fail", "inconclusive", "starved", "n/a"]
# What an analysis figure is measured in, so every view shows it alike: ratio (a share or rate:
# shown in %), seconds (shown in ms), count (whole), number (a mean or ratio of means).
MetricUnit = Literal["ratio", "seconds", "count", "number"]
# The units of the rows stored before rows carried one (their names said it).
_UNITS_OF_OLD_ROWS: dict[str, MetricUnit] = {
    "error rate": "ratio",
    "p95 latency (s)": "seconds",
    "p95 TTFT (s)": "seconds",
    "canary restarts": "count",
}

# The plan when none is given: the --canary weight, then these, the last always 100.
DEFAULT_LATER_STEPS = (50, 100)
MAX_STEPS = 20
# A step's weight: the percent of requests the canary gets.
StepWeight = Annotated[int, Field(ge=1, le=100)]


class RolloutCreate(ApiModel):
    """`POST /api/v1/deployments/{name}/rollout` (operator): start a rollout of a new version, a
    new engine config, or both."""

    to: str | None = Field(
        default=None, max_length=200, description="VERSION or MODEL:VERSION of the new version"
    )
    engine_config: dict[str, Any] | None = Field(
        default=None, description="the canary's engine config (the whole document)"
    )
    canary: int = Field(default=10, ge=1, le=99, description="first step's weight, percent")
    steps: list[StepWeight] | None = Field(
        default=None, description="the weights, rising, the last 100 (overrides canary)"
    )
    surge: int = Field(default=0, ge=0, le=64, description="extra canary instances allowed")
    policy: RolloutPolicy = Field(default_factory=RolloutPolicy)
    reason: PlainText = Field(default="", max_length=500)

    _engine_config = field_validator("engine_config")(
        lambda v: None if v is None else _check_engine_config(v)
    )

    @field_validator("steps")
    @classmethod
    def _rising_to_100(cls, steps: list[int] | None) -> list[int] | None:
        if steps is None:
            return None
        if not steps or len(steps) > MAX_STEPS:
            raise ValueError(f"steps needs 1 to {MAX_STEPS} weights")
        if any(b <= a for a, b in pairwise(steps)):
            raise ValueError(f"step weights must rise: {steps}")
        if steps[-1] != 100:
            raise ValueError(f"the last step must be 100 (promotion), not {steps[-1]}")
        return steps

    @model_validator(mode="after")
    def _something_new(self) -> RolloutCreate:
        if self.to is None and self.engine_config is None:
            raise ValueError("a rollout needs a new version (to), a new engine_config, or both")
        return self

    def weights(self) -> list[int]:
        """The plan: `steps`, or the canary weight then `DEFAULT_LATER_STEPS` above it."""
        if self.steps is not None:
            return list(self.steps)
        return [self.canary, *(w for w in DEFAULT_LATER_STEPS if w > self.canary)]


class RolloutAction(ApiModel):
    """`POST .../rollout/{promote,abort,pause,resume}` (operator)."""

    reason: PlainText = Field(default="", max_length=500)
    full: bool = Field(default=False, description="promote: skip the remaining steps")


class RollbackCreate(ApiModel):
    """`POST /api/v1/deployments/{name}/rollback` (operator)."""

    to: str | None = Field(
        default=None, max_length=200, description="VERSION or MODEL:VERSION; default: previous"
    )
    all_at_once: bool = False
    reason: PlainText = Field(default="", max_length=500)


class RestartCreate(ApiModel):
    """`POST /api/v1/deployments/{name}/restart` (operator): every instance, or those named."""

    host: str | None = Field(default=None, max_length=63)
    instance: int | None = Field(default=None, ge=1, le=INT32_MAX)
    reason: PlainText = Field(default="", max_length=500)


class MetricVerdict(ApiModel):
    """One row of an analysis: a metric of each pool, the limit, and what it says."""

    metric: str
    unit: MetricUnit = Field(description="what `stable` and `canary` are measured in")
    stable: float | None
    canary: float | None
    limit: str = Field(description="the rule, e.g. '<= stable + 0.01' or '<= 1.25x stable'")
    verdict: Verdict
    note: str = ""

    @model_validator(mode="before")
    @classmethod
    def _unit_of_old_rows(cls, data: Any) -> Any:
        # Analyses are stored as written; those from before `unit` get theirs by name.
        if isinstance(data, dict) and "unit" not in data:
            return {**data, "unit": _UNITS_OF_OLD_ROWS.get(data.get("metric", ""), "number")}
        return data


class Analysis(ApiModel):
    """The comparison of canary and stable over one interval of one step."""

    time: datetime
    step: int = Field(description="1-based step number")
    weight: int
    since: datetime
    verdict: Verdict
    stable_requests: int
    canary_requests: int
    metrics: list[MetricVerdict]


class InstanceProgress(ApiModel):
    """An instance of the deployment as a rollout, rollback or restart sees it."""

    id: int
    host: str
    version: str
    pool: Literal["stable", "canary"]
    state: str
    ready: bool
    restarts: int


class HostStaging(ApiModel):
    """Pre-staging of the new snapshot on one host of the deployment."""

    host: str
    state: Literal["fetching", "ready", "failed"]
    error: str = ""


class RolloutOut(ApiModel):
    """A rollout, rollback or restart as it stands. Serialised with `from` (a Python keyword:
    the field is `from_`); `dctl rollout status --json` prints this object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: int
    deployment: str
    kind: RolloutKind
    state: RolloutState
    step: int = Field(description="1-based step; 0 before the first step's canary is ready")
    steps: list[int] = Field(description="the plan's weights")
    weight: int = Field(description="percent of requests the canary gets now")
    served: float | None = Field(
        default=None,
        description="the canary's share (0..1) of the requests the gateways served since this "
        "interval began, to set against `weight`; None: not analysing, or no requests yet",
    )
    from_: str = Field(alias="from", description="MODEL:VERSION before")
    to: str = Field(description="MODEL:VERSION after")
    engine_config_changed: bool
    phase: RolloutPhase
    canary_instances: int
    canary_ready: int
    stable_ready: int
    step_started_at: datetime | None
    time_left_s: float | None = Field(description="until this step's analysis; None: not timed")
    policy: RolloutPolicy
    analysis: Analysis | None = Field(description="the latest analysis")
    analyses: list[Analysis] = Field(default_factory=list)
    reason: str = Field(description="why it is in its state (abort: the metric and figures)")
    actor: str
    instances: list[InstanceProgress] = Field(default_factory=list)
    staging: list[HostStaging] = Field(
        default_factory=list, description="per host, while the new snapshot is pre-staged"
    )
    created_at: datetime
    updated_at: datetime

    def as_json(self) -> dict[str, Any]:
        """The document `--json` prints: `from` spelled as such."""
        return self.model_dump(mode="json", by_alias=True)
