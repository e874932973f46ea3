"""What the autoscaler remembers of a deployment between rounds (`Deployment.autoscale_state`)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from protocol.autoscale import AutoscaleDecision


class AutoscaleState(BaseModel):
    """The clocks its rules run on, and its last decision; frozen: a change is a new value."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Since when the queue per instance has been over target (None: it is not).
    over_since: datetime | None = None
    # Since when fewer instances would carry the load; the most of them wanted in that time.
    under_since: datetime | None = None
    under_floor: int = 0
    # The last change of the instance count (the cooldown runs from it).
    last_change_at: datetime | None = None
    pinned_at_max_since: datetime | None = None
    starved_since: datetime | None = None
    starved_reason: str = ""
    last_decision: AutoscaleDecision | None = None
