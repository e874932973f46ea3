"""The agent's exception hierarchy, written out in one place.

Settings the agent cannot use raise `agent.settings.SettingsError` (the bottom layer's); what goes
wrong while it runs is one of these, each with a message that says what to do next.
"""

from __future__ import annotations


class AgentFailure(Exception):
    """The agent cannot start or go on running (root without --allow-root, a port in use, the
    control plane refusing it); the process exits 1 with the message."""
