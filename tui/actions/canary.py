"""The canary form's rules: its fields as typed, and the `RolloutCreate` they make or the fields
that are wrong, each named with what to write instead. Text in, request or errors out.

The semantics are `dctl rollout DEPLOYMENT --to ... --canary ... --steps ... --interval ...`'s:
the canary percent is the first step, steps (when given) are the whole plan, the interval is
how long each step is held and analysed.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from protocol.rollout_policy import MAX_INTERVAL_S, RolloutPolicy
from protocol.rollouts import RolloutCreate
from protocol.version_ref import VersionRef
from runtime.durations import parse_duration

DEFAULT_CANARY = "10"
DEFAULT_STEPS = "10,50,100"
DEFAULT_INTERVAL = "5m"


@dataclass(frozen=True)
class CanaryFields:
    """The form's inputs as typed (defaults as the form opens)."""

    version: str = ""
    canary: str = DEFAULT_CANARY
    steps: str = DEFAULT_STEPS
    interval: str = DEFAULT_INTERVAL


@dataclass(frozen=True)
class FieldError:
    """One wrong field: its name in the form and what to write instead."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _percent(text: str) -> int | None:
    value = text.strip().removesuffix("%").strip()
    return int(value) if value.isdigit() else None


def _weights(text: str) -> list[int] | None:
    items = [_percent(item) for item in text.split(",")]
    return None if any(item is None for item in items) else [w for w in items if w is not None]


def read_canary(fields: CanaryFields) -> RolloutCreate | list[FieldError]:
    """The rollout FIELDS ask for, or every field that is wrong (nothing is sent then)."""
    errors: list[FieldError] = []
    version = fields.version.strip()
    if not version:
        errors.append(FieldError("version", "name the version to roll out, e.g. v2 or demo:v2"))
    first = _percent(fields.canary)
    if first is None or not 1 <= first <= 99:
        errors.append(FieldError("canary %", "write a percent from 1 to 99, e.g. 10"))
        first = None  # one error per field: steps are not checked against it
    plan: list[int] | None = None
    if fields.steps.strip():
        plan = _weights(fields.steps)
        if plan is None:
            hint = "write rising percents ending at 100, e.g. 10,50,100"
            errors.append(FieldError("steps", hint))
        elif first is not None and plan[0] != first:
            # Two fields for one number: refuse a disagreement rather than guess which one won.
            errors.append(FieldError("steps", f"the first step ({plan[0]}%) must be the canary % "
                                              f"({first}%), or leave steps empty"))  # fmt: skip
    interval_s: int | None = None
    if fields.interval.strip():
        interval_s = parse_duration(fields.interval)
        if interval_s is None or interval_s > MAX_INTERVAL_S:
            errors.append(FieldError("interval", "write a duration like 30s, 5m or 1h (up to 24h)"))
    if errors:
        return errors
    assert first is not None
    try:
        return RolloutCreate(
            to=version, canary=first, steps=plan, policy=RolloutPolicy(interval_s=interval_s)
        )
    except ValidationError as exc:
        return [_field_error(error) for error in exc.errors()]


_FIELD_OF = {"to": "version", "canary": "canary %", "steps": "steps", "policy": "interval"}


def _field_error(error: ErrorDetails) -> FieldError:
    """A pydantic error of `RolloutCreate` as the form's field it came from."""
    first = str(error["loc"][0]) if error["loc"] else "version"
    message = error["msg"].removeprefix("Value error, ")
    return FieldError(_FIELD_OF.get(first, first), message)


def completions(versions: tuple[str, ...]) -> list[str]:
    """What the version input completes to: every MODEL:VERSION, and each bare VERSION."""
    bare = [VersionRef.parse(v).version for v in versions]
    return list(dict.fromkeys([*versions, *bare]))
