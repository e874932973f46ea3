"""A rank that dies makes the others fail at once, not after the collective timeout: the group
is one unit that its supervisor restarts."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engine.parallel.driver import ParallelSdarModel, load_parallel_model
from engine.parallel.launcher import start_local_group
from engine.parallel.plan import ParallelPlan

pytestmark = pytest.mark.usefixtures("rank_zero_thread")
TIMEOUT_S = 60  # the group's collective timeout; failures must come far sooner


def test_rank_zero_fails_its_next_forward_when_a_worker_dies(sdar_dir: Path) -> None:
    group = start_local_group(2, threads=1, timeout_s=TIMEOUT_S)
    try:
        model = load_parallel_model(group.group, sdar_dir, ParallelPlan(2))
        assert isinstance(model, ParallelSdarModel)
        ids = torch.tensor([[5, 6, 7]])
        model(ids)
        worker = group.workers[0]
        assert worker.pid is not None
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            model(ids)
        assert time.monotonic() - start < 10
        assert group.exited() == {1: -signal.SIGKILL}
    finally:
        group.close(timeout_s=5)


def test_a_worker_exits_with_an_error_when_rank_zero_goes(sdar_dir: Path) -> None:
    group = start_local_group(2, threads=1, timeout_s=TIMEOUT_S)
    try:
        load_parallel_model(group.group, sdar_dir, ParallelPlan(2))
        group.group.leave()  # as if rank 0 died: no Stop, its sockets closed
        group.workers[0].join(10)
        assert group.exited() == {1: 1}
    finally:
        for worker in group.workers:
            worker.kill()
            worker.join()
