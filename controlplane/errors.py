"""Why a control-plane process cannot start or go on: what `controlplane.main.run` raises.

A setting it cannot use raises `controlplane.settings.SettingsError` instead (a usage error).
What the REST API answers is in `api/errors.py`, and the rules' refusals in `services/errors.py`.
"""

from __future__ import annotations


class ControlPlaneFailure(Exception):
    """The control plane cannot start (a schema behind, a database it cannot reach, a port in
    use) or stopped without serving; the message says what to do, the process exits 1."""


class AdminTokenDiscarded(ControlPlaneFailure):
    """The first admin token reached nobody, so it was deleted: the next start makes a new one."""

    def __init__(self) -> None:
        super().__init__(
            "the first admin token reached nobody, so it was deleted: the next start makes a "
            "new one"
        )
