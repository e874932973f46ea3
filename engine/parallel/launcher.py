"""A group on this machine: this process is rank 0, ranks 1..N-1 are worker processes.

For tests and for `engine.serve --parallel N`: rank 0 opens the rendezvous store on a free local
port first (no port to pick, none to race for), starts the workers with the torchrun-style
variables (`engine.parallel.worker.run_rank`), waits for every worker to check in (failing at
once when one exits before it does), then joins. `LocalGroup.close` stops the workers through
rank 0's `Stop` and reaps them; a worker that does not exit in time is killed.

Workers are forked from multiprocessing's fork server, which imports torch and the engine once
(`FORKSERVER_PRELOAD`) and lives as long as this process: N - 1 workers, and every later group,
start in a fraction of a second instead of each importing torch (seconds of CPU apiece). As with
every multiprocessing start method but fork, the launching program's main module must be safe
to import (`if __name__ == "__main__":`; console scripts and `python -m` modules are). An agent
that launches the ranks itself runs `python -m engine.parallel.worker` with the same variables.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from types import TracebackType

import torch.distributed as dist

from engine.errors import EngineError
from engine.parallel.group import CHECK_IN, COLLECTIVE_TIMEOUT_S, RankGroup, join_group
from engine.parallel.worker import LOG_FORMAT_ENV, LOG_LEVEL_ENV, THREADS_ENV, run_rank

# torch._dynamo too: a model built on the meta device runs torch's reference initialisers,
# which import it on first use (seconds of CPU in every worker otherwise).
FORKSERVER_PRELOAD = ["engine.parallel.worker", "torch._dynamo"]


@dataclass
class LocalGroup:
    """Rank 0 (`group`, this process) and the worker processes of ranks 1..N-1."""

    group: RankGroup
    workers: list[BaseProcess]

    def exited(self) -> dict[int, int]:
        """Ranks whose process has exited, with its exit code."""
        return exited(self.workers)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the workers (`RankGroup.close`) and reaps them; one that has not exited
        within TIMEOUT_S is killed."""
        if self.exited():
            self.group.leave()  # the others fail at once; the kill below reaps them
        else:
            self.group.close()
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.exitcode is None:
                worker.kill()
                worker.join()

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def start_local_group(
    size: int,
    *,
    threads: int | None = None,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    start_timeout_s: float = 120.0,
    backend: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "info",
    log_format: str = "kv",
) -> LocalGroup:
    """Starts ranks 1..SIZE-1 and joins them as rank 0. THREADS: torch's CPU threads of each
    worker (this process keeps its own setting). TIMEOUT_S: the group's collective timeout
    (`engine.parallel.group`). HOST / PORT: the rendezvous (port 0: a free one, the kernel's
    choice). LOG_LEVEL / LOG_FORMAT: the workers' logging (`runtime.logs`).
    Raises EngineError when a worker exits or does not check in within START_TIMEOUT_S."""
    if size < 1:
        raise ValueError(f"a group needs at least one rank, got {size}")
    store = dist.TCPStore(
        host,
        port,
        size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    # This process's environment now (the fork server's is the one it started with).
    env = dict(os.environ)
    env.update(MASTER_ADDR=host, MASTER_PORT=str(store.port), WORLD_SIZE=str(size))
    env.update({LOG_LEVEL_ENV: log_level, LOG_FORMAT_ENV: log_format})
    if threads:
        env[THREADS_ENV] = str(threads)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    workers: list[BaseProcess] = []
    try:
        for rank in range(1, size):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            worker = context.Process(target=run_rank, args=(rank_env,), name=f"rank-{rank}")
            worker.start()
            workers.append(worker)
        _await_check_in(store, workers, start_timeout_s)
        group = join_group(
            {"RANK": "0", "WORLD_SIZE": str(size)},
            store=store,
            backend=backend,
            timeout_s=timeout_s,
        )
    except BaseException:
        for started in workers:
            started.kill()
            started.join()
        raise
    return LocalGroup(group, workers)


def exited(workers: list[BaseProcess]) -> dict[int, int]:
    """Ranks (1..N-1, in WORKERS' order) whose process has exited, with its exit code."""
    codes = {rank: w.exitcode for rank, w in enumerate(workers, start=1)}
    return {rank: code for rank, code in codes.items() if code is not None}


def _await_check_in(store: dist.TCPStore, workers: list[BaseProcess], limit_s: float) -> None:
    keys = [f"{CHECK_IN}{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + limit_s
    while not store.check(keys):
        gone = exited(workers)
        if gone:
            rank, code = next(iter(gone.items()))
            raise EngineError(f"rank {rank} exited with code {code} before joining the group")
        if time.monotonic() > deadline:
            raise EngineError(f"the ranks did not join the group within {limit_s:.0f} s")
        time.sleep(0.02)
