"""The other ranks of a server whose model is split over several processes (`parallel.size`).

The server process is rank 0: it serves HTTP, schedules and drives the model; ranks 1..N-1 run
on this machine as its children (`engine.parallel.launcher`), in its process group, so an agent
that kills the group reaches every rank and a SIGTERM to rank 0 drains the instance. The group
is one unit:
- the rendezvous is `MASTER_ADDR:MASTER_PORT` when the agent gave them, else a free local port;
- a rank that exits while the instance serves makes rank 0 exit non-zero at once (its peers'
  collectives already fail), taking the others with it, so the supervisor restarts the whole
  instance with its backoff;
- at shutdown rank 0 stops the others (`Stop`), and each exits 0.

Threads: `resources.threads` is torch's CPU threads per rank. Left unset with N > 1 ranks, each
rank gets this process's cores divided by N (at least 1), so N ranks on one machine never ask
for more threads than it has cores.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol.engine_config import ServeConfig

if TYPE_CHECKING:
    from engine.parallel.launcher import LocalGroup

log = logging.getLogger("engine.serve")

EXIT_RANK_LOST = 1  # the process exit code when another rank of the instance died
WATCH_INTERVAL_S = 0.1


def parallel_size(config: ServeConfig) -> int:
    """The instance's ranks: `parallel.size`, or unset one per visible GPU (the agent's
    CUDA_VISIBLE_DEVICES) when the device is CUDA (or auto with a GPU), one elsewhere."""
    if config.parallel.size is not None:
        return config.parallel.size
    device = config.resources.device
    if device not in ("auto", "cuda"):
        return 1  # cpu, mps, or one pinned GPU (cuda:N)
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def rank_threads(config: ServeConfig, size: int) -> int | None:
    """torch's CPU threads for each rank: `resources.threads`, else for several ranks this
    process's cores split over them (at least 1); None (torch's default) for one rank."""
    if config.resources.threads is not None or size == 1:
        return config.resources.threads
    return max(1, len(os.sched_getaffinity(0)) // size)


def check_plan(config: ServeConfig, size: int) -> None:
    """Raises ParallelPlanError (naming `parallel.size` or `parallel.experts` and the model's
    figures) unless the checkpoint splits over SIZE ranks; before any rank starts."""
    from engine.parallel.loading import checkpoint_family
    from engine.parallel.plan import ParallelPlan

    path = config.model.path
    if checkpoint_family(path) == "diffusion-gemma":
        from engine.families.diffusion_gemma.weights import load_diffusion_gemma_config

        ParallelPlan(size, config.parallel.experts).check(load_diffusion_gemma_config(path))
    else:
        from engine.loader import load_checkpoint_config

        ParallelPlan(size, config.parallel.experts).check(load_checkpoint_config(path))


@dataclass
class ServedRanks:
    """Ranks 1..N-1 of this server's instance, watched until `close`."""

    local: LocalGroup
    closing: threading.Event = field(default_factory=threading.Event)

    @property
    def size(self) -> int:
        """Ranks of the instance, this one included."""
        return self.local.group.size

    def watch(self) -> None:
        """Starts the watch: a rank that exits before `close` ends this process (module
        docstring)."""
        threading.Thread(target=self._watch, name="rank-watch", daemon=True).start()

    def close(self) -> None:
        """Stops the other ranks (each exits 0) and reaps them; idempotent."""
        if self.closing.is_set():
            return
        self.closing.set()
        self.local.close()
        log.info("ranks stopped", extra={"exit_codes": self.local.exited()})

    def _watch(self) -> None:
        while not self.closing.wait(WATCH_INTERVAL_S):
            gone = self.local.exited()
            if gone and not self.closing.is_set():
                self._lost(gone)

    def _lost(self, gone: dict[int, int]) -> None:
        rank, code = next(iter(gone.items()))
        log.error(
            "a rank of this instance exited; the instance stops so that it restarts whole",
            extra={"rank": rank, "exit_code": code, "ranks": self.size},
        )
        for worker in self.local.workers:
            if worker.exitcode is None:
                worker.kill()
        for worker in self.local.workers:
            worker.join(5)
        logging.shutdown()
        # Not a clean shutdown on purpose: the engine's collectives already fail, and the
        # requests in flight cannot finish without the lost rank.
        os._exit(EXIT_RANK_LOST)


def start_ranks(config: ServeConfig) -> ServedRanks | None:
    """Ranks 1..N-1 started and joined with this process as rank 0, after the plan is checked
    against the checkpoint; None when the instance has one rank. Raises ParallelPlanError,
    CheckpointError, or EngineError when a rank does not start."""
    size = parallel_size(config)
    if size == 1:
        return None
    check_plan(config, size)
    from engine.parallel.launcher import start_local_group

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "0") or 0)
    threads = rank_threads(config, size)
    log.info(
        "starting ranks",
        extra={"ranks": size, "experts": config.parallel.experts, "threads_per_rank": threads,
               "rendezvous": f"{host}:{port or 'free port'}"},
    )  # fmt: skip
    local = start_local_group(
        size,
        threads=threads,
        host=host,
        port=port,
        log_level=config.logging.level,
        log_format=config.logging.format,
    )
    ranks = ServedRanks(local)
    ranks.watch()
    return ranks
