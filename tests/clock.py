"""The one fake clock of the test suite: time that moves only when a test says so."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

START = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
MONOTONIC_START = 1000.0


class FakeClock:
    """An injected clock that moves only when a test calls `advance`.

    The parts take a clock as a plain callable of one of two kinds, and one FakeClock serves both,
    moving them together:
    - the wall clock, `Callable[[], datetime]` (the control plane, the gateway's traffic windows):
      pass the clock itself; calling it gives an aware UTC datetime, START unless told otherwise;
    - elapsed seconds, `Callable[[], float]` in place of `time.monotonic` (the gateway's balancer,
      the agent's supervisor and runtime): pass `clock.monotonic`.
    """

    def __init__(
        self, start: datetime = START, *, monotonic_start: float = MONOTONIC_START
    ) -> None:
        self._real_time = False
        self._start = start
        # Each reading is summed step by step, as `now += step` would, so a test's float and
        # datetime arithmetic comes out to the same bits as when it kept the time itself.
        self._advanced = timedelta()
        self._seconds = monotonic_start

    @classmethod
    def on_real_time(cls) -> FakeClock:
        """Real time plus what the test advanced: for a served control plane whose rate limits must
        see the real spacing of requests while a test jumps past a silence allowance at once."""
        clock = cls(monotonic_start=0.0)
        clock._real_time = True
        return clock

    def __call__(self) -> datetime:
        """The wall clock."""
        start = datetime.now(UTC) if self._real_time else self._start
        return start + self._advanced

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, as `time.monotonic` counts them."""
        return time.monotonic() + self._seconds if self._real_time else self._seconds

    def advance(self, seconds: float) -> None:
        """Move time forward by SECONDS (both readings)."""
        self._advanced += timedelta(seconds=seconds)
        self._seconds += seconds
