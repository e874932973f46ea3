"""The base of every API body, and the rule every JSON body keeps: its numbers are finite."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict

# Where a value sits in a JSON document: keys and list indices from the top.
JsonPath = tuple[str | int, ...]


class ApiModel(BaseModel):
    """Base of API bodies: unknown request fields are an error, so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid")


def non_finite_number(document: Any) -> JsonPath | None:
    """Where parsed JSON holds a number that is not finite, if anywhere (the first, in document
    order).

    Python's JSON parser reads `NaN`, `Infinity` and numbers beyond a float's range (`1e309`)
    as floats nobody can store or send on: pydantic writes them back as null, and a free-form
    value (a deployment's engine_config) reaches the agents that way, which then refuse it.
    """
    if not _holds_non_finite(document):
        return None  # the common case, kept fast: a 64 MiB manifest is walked in a blink
    stack: list[tuple[JsonPath, Any]] = [((), document)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path
        if isinstance(value, dict):
            stack.extend(reversed([((*path, key), item) for key, item in value.items()]))
        elif isinstance(value, list):
            stack.extend(reversed([((*path, index), item) for index, item in enumerate(value)]))
    return None


def _holds_non_finite(document: Any) -> bool:
    stack = [document]
    while stack:
        value = stack.pop()
        if type(value) is float and not math.isfinite(value):
            return True
        if type(value) is dict:
            stack.extend(value.values())
        elif type(value) is list:
            stack.extend(value)
    return False
