"""The vocabulary of rollout records: their kinds, states, phases and restart stages.

Standard library only, apart from the contracts in `protocol.rollouts` that use it, so what
only names a state (the CLI's views, `dctl --help`) never loads pydantic.
"""

from __future__ import annotations

from enum import StrEnum


class RolloutKind(StrEnum):
    """What a record changes: a rollout goes step by step with analysis; a rollback goes back at
    once without; a restart replaces engine processes; a manual canary is held where the
    operator sets it (`dctl deploy canary`)."""

    ROLLOUT = "rollout"
    ROLLBACK = "rollback"
    RESTART = "restart"
    MANUAL = "manual"


class RolloutState(StrEnum):
    """Where a record stands for the operator; the values are the wire's and the store's."""

    PROGRESSING = "progressing"
    PAUSED = "paused"
    PROMOTED = "promoted"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"
    COMPLETED = "completed"


# The states in which a record is under way: its canary runs and takes traffic, and it is the
# deployment's one active record. Every other state is final.
ACTIVE_STATES = (RolloutState.PROGRESSING, RolloutState.PAUSED)
# The kinds that run a canary of another version, which a rollback ends (back to `from`).
CANARY_KINDS = (RolloutKind.ROLLOUT, RolloutKind.MANUAL)


class RolloutPhase(StrEnum):
    """What the machine does within an active record (`controlplane.rollouts.machine`)."""

    STAGING = "staging"
    WAITING = "waiting"
    ANALYSING = "analysing"
    PROMOTING = "promoting"
    RESTARTING = "restarting"
    ENDING = "ending"
    DONE = "done"


class RestartStage(StrEnum):
    """Where a restart's current instance is: held stopped until seen stopped, then running
    until ready again."""

    STOPPING = "stopping"
    STARTING = "starting"
