"""A rollout record's settings and progress as typed values (the `Rollout` row's `settings` and
`progress` columns), in place of the free-form `spec` dict they were.

Both are frozen: a change is a new value assigned to the row (`model_copy(update=...)`), which is
also what tells the store the column changed.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from protocol.rollout_policy import RolloutPolicy
from protocol.rollout_states import RestartStage, RolloutState


class RolloutSettings(BaseModel):
    """What a record was started with and keeps: the resolved analysis policy, the extra canary
    instances allowed, and whether a promotion moves every instance at once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: RolloutPolicy = Field(default_factory=RolloutPolicy)
    surge: int = Field(default=0, ge=0)
    all_at_once: bool = False


class Promotion(StrEnum):
    """A promote left for the next round (records from before promotes took effect at once)."""

    STEP = "step"
    FULL = "full"


class RolloutProgress(BaseModel):
    """How far a record has come, beyond its state, phase and step: what the machine needs to
    carry on where it was after a control plane restart."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The analysed interval starts here (the previous analysis, or the step's weight taking
    # effect); the step's whole time since its weight took effect, for an inconclusive interval.
    interval_since: datetime | None = None
    step_since: datetime | None = None
    # The canary's summed restart counters when the step began: the analysis counts the rise.
    restarts_at: int = 0
    # Intervals in a row judged starved: the first extends the step (the gateways may not have
    # routed to a canary that just became ready), the second pauses.
    starved: int = 0
    # The last state a notification went out for (None: none yet).
    notified_state: RolloutState | None = None
    # A promote not carried out yet: only in records from before promotes took effect at once
    # (migration 0007 moved them here); the next round carries it out.
    pending: Promotion | None = None
    # A restart's instances: to restart, done, the one under way and where it is.
    queue: tuple[int, ...] = ()
    done: tuple[int, ...] = ()
    current: int | None = None
    stage: RestartStage | None = None
