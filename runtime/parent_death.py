"""Children that do not outlive their parent (Linux's `PR_SET_PDEATHSIG`).

A process that starts helpers (the demo's servers, the agent's front for a command engine) may
itself be killed with SIGKILL, which it cannot pass on; without this its children would live on
with init as their parent, holding ports and GPUs.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` after which Linux sends the child SIG when this process dies; None on
    other systems.

    The signal follows the thread that forks, not the process: children must be started from a
    thread that lives as long as the parent (the main thread does).
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm
