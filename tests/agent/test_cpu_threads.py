"""The default CPU threads of an engine: the host's cores shared by its instances."""

from __future__ import annotations

from agent.cpu_threads import threads_per_instance


def test_cores_are_shared_evenly_and_every_engine_gets_at_least_one_thread() -> None:
    assert [threads_per_instance(8, n) for n in (0, 1, 2, 3, 8, 9)] == [8, 8, 4, 2, 1, 1]
    assert threads_per_instance(10_000, 1) == 4096  # what an engine config may hold
