"""`MODEL:VERSION`, the one way a model version is written for people, and read back from them.

Between the parts a version travels as its id (the routing table's pools, the gateways' traffic
windows, the traffic query's rows, the rollout analysis): two spellings of one version cannot
disagree there, and nothing is parsed back out of a label. `VersionRef` is what the edges use:
the control plane and the CLI, TUI and doctor write a version with it (messages, tables, the
gateway's `x-dctl-version` header, metric labels), and read what an operator typed with
`VersionRef.parse`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.wire import NAME_PATTERN, VERSION_PATTERN


@dataclass(frozen=True, order=True)
class VersionRef:
    """A model version by its names: `str()` is `MODEL:VERSION`."""

    model: str
    version: str

    def __str__(self) -> str:
        return f"{self.model}:{self.version}"

    @classmethod
    def parse(cls, text: str, model: str | None = None) -> VersionRef:
        """Read `MODEL:VERSION`, or a bare `VERSION` of MODEL when MODEL is given, checking both
        halves; ValueError says what is wrong."""
        name, sep, version = text.partition(":")
        if not sep and model is not None:
            name, version = model, text
            wanted = "VERSION or NAME:VERSION (e.g. v1, demo:v1)"
        else:
            wanted = "NAME:VERSION (e.g. demo:v1)"
        if not re.match(NAME_PATTERN, name) or not re.match(VERSION_PATTERN, version):
            raise ValueError(f"{text!r} is not {wanted}")
        return cls(name, version)
