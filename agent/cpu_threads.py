"""How many CPU threads an engine gets when its engine config sets none.

torch sizes its thread pool to every core of the machine by default, so two engines on one host
each run as many threads as there are cores and spend their time preempting each other: two
engines on 2 cores served 5 req/s, most requests over 300 ms, against 250 req/s with one thread
each. The agent therefore splits the cores it may run on between the instances placed on its
host. The same rule holds on a GPU host: an engine's CPU threads tokenize, schedule and feed the
GPU there, and N engines at all cores each oversubscribe the CPU just the same.
"""

from __future__ import annotations

import os

from protocol.engine_config import MAX_THREADS


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (a cgroup's cpuset, `taskset`), where the
    system has one, else every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity masks (macOS): the whole machine
        return os.cpu_count() or 1


def threads_per_instance(cores: int, instances: int) -> int:
    """CORES shared evenly by INSTANCES engines: at least one thread each, and no more than an
    engine config may hold."""
    return min(MAX_THREADS, max(1, cores // max(instances, 1)))
