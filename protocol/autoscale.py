"""Autoscaling: the policy an operator sets on a deployment, and what the autoscaler reports.

`dctl deploy autoscale NAME --min 1 --max 8 ...` and `autoscale:` in a deployment's JSON are the
same `AutoscalePolicy`. With one set, the deployment's serving instance count (`replicas`) is the
autoscaler's to choose between `min` and `max`, spread over its placement's hosts where GPUs are
free; `instances_per_host` no longer applies. `standby` more instances are kept loaded and ready
but out of the gateway's pools, so a scale-up promotes one (seconds) instead of waiting for a
model load. `min: 0` lets an idle deployment stop its last instance: the gateway then holds the
next request (up to `cold_start_timeout_s`) while the autoscaler starts one.

The signal is what the engines report per instance: requests waiting for a batch slot (queue)
and requests running out of `service.max_concurrent_requests` (utilisation).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Far more than one fleet runs of one deployment; a typo (`--max 8000`) is refused instead.
MAX_REPLICAS = 512
MAX_STANDBY = 64


class AutoscalePolicy(BaseModel):
    """When to add and remove a deployment's instances (`autoscale:` in its JSON)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="fewest serving instances")
    max: int = Field(default=8, ge=1, le=MAX_REPLICAS, description="most serving instances")
    target_queue: float = Field(
        default=4.0,
        gt=0,
        le=1_000_000,
        description="requests waiting per serving instance above which it scales up",
    )
    target_utilization: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="running / max concurrent requests below which it scales down",
    )
    up_after_s: float = Field(
        default=30.0, ge=0, le=86_400, description="the queue stays over target this long"
    )
    down_after_s: float = Field(
        default=600.0, ge=0, le=7 * 86_400, description="utilisation stays under target this long"
    )
    cooldown_s: float = Field(
        default=30.0, ge=0, le=86_400, description="no other change this long after one"
    )
    standby: int = Field(
        default=0, ge=0, le=MAX_STANDBY, description="loaded instances kept out of the pools"
    )
    cold_start_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=3600,
        description="with min 0: how long the gateway holds a request while an instance starts",
    )

    def standby_beside(self, replicas: int) -> int:
        """Standby instances kept beside REPLICAS serving ones: none for a deployment scaled to
        zero (it releases every GPU), else `standby`."""
        return self.standby if replicas > 0 else 0

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalePolicy:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is above max ({self.max}): give min <= max")
        return self


AutoscaleAction = Literal["up", "down", "wake", "clamp", "unplaced"]


class AutoscaleDecision(BaseModel):
    """One change the autoscaler made (or could not place), with the figures that caused it."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    time: datetime
    action: AutoscaleAction
    from_replicas: int = Field(ge=0)
    to_replicas: int = Field(ge=0)
    reason: str = Field(max_length=1000)
    figures: dict[str, Any] = Field(default_factory=dict)


class AutoscaleStatus(BaseModel):
    """Where an autoscaled deployment stands (`dctl deploy show`, the TUI, `dctl doctor`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    replicas: int = Field(ge=0, description="serving instances the autoscaler wants now")
    standby: int = Field(default=0, ge=0, description="standby instances it keeps beside them")
    serving_ready: int = Field(default=0, ge=0, description="serving instances ready now")
    standby_ready: int = Field(default=0, ge=0, description="standby instances ready now")
    placed: int = Field(default=0, ge=0, description="instances placed (serving + standby)")
    queue_per_instance: float | None = Field(default=None, description="waiting / ready serving")
    utilization: float | None = Field(default=None, description="running / capacity, 0..1")
    pinned_at_max_since: datetime | None = Field(
        default=None, description="since when it wants more than max"
    )
    starved_since: datetime | None = Field(
        default=None, description="since when fewer instances are placed than it wants"
    )
    starved_reason: str = Field(default="", max_length=1000)
    last_decision: AutoscaleDecision | None = None
