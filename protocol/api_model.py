"""The base of every API body."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ApiModel(BaseModel):
    """Base of API bodies: unknown request fields are an error, so typos do not pass silently."""

    model_config = ConfigDict(extra="forbid")
