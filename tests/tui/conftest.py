"""Fixtures of the TUI tests: `plane`, one real control plane for the whole session (seeded as
`tests.tui.plane` says: hosts gpu-1 and gpu-2 ready with GPU samples, gpu-3 not ready, model
demo v1..v3, deployment web on demo:v1 with an active rollout to v2 at step 1, events, traffic);
`seeded`, the same plane put back in that state after a test that changes it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.tui.plane import Plane


@pytest.fixture(scope="session")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    """The seeded control plane, shared by every TUI test (restore what you change: `seeded`)."""
    running = Plane(tmp_path_factory.mktemp("tui-plane"))
    try:
        running.seed()
        yield running
    finally:
        running.close()


@pytest.fixture
def seeded(plane: Plane) -> Iterator[Plane]:
    """The plane for a test that changes it: running and seeded again afterwards."""
    yield plane
    plane.start_if_stopped()
    plane.reseed()
