"""How fresh the data on screen is: the last refresh that worked, and why the latest failed.

One `Link` per app, shared by every view, so the banner reads the same whichever view is up.
Plain state with the clock passed in: no textual, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tui import health
from tui.format import seconds_since

# A refresh still waiting after this many refresh periods (and at least this many seconds)
# makes the control plane "slow".
SLOW_PERIODS = 3
SLOW_MIN_S = 3.0


@dataclass
class Link:
    """The state of the app's link to the control plane."""

    last_ok: datetime | None = None
    error: str | None = None
    unreachable: bool = True  # the last failure got no answer at all (else an error answer)

    def succeeded(self, now: datetime) -> None:
        """A refresh worked at NOW: the banner goes."""
        self.last_ok = now
        self.error = None

    def failed(self, error: str, unreachable: bool = True) -> None:
        """A refresh failed with ERROR (UNREACHABLE: no answer came): the banner says so until
        one works again."""
        self.error = error
        self.unreachable = unreachable

    def banner(self, now: datetime, waiting_since: datetime | None, refresh_s: float) -> str | None:
        """The banner text at NOW, given the oldest refresh still waiting (None: none)."""
        waited = seconds_since(waiting_since, now)
        slow = waited is not None and waited >= max(SLOW_MIN_S, SLOW_PERIODS * refresh_s)
        age_s = seconds_since(self.last_ok, now)
        return health.stale_banner(age_s, self.error, slow, self.unreachable)
