"""The process group of one model instance: N ranks on `torch.distributed`.

A rank joins from the torchrun-style environment (`MASTER_ADDR`, `MASTER_PORT`, `RANK`,
`WORLD_SIZE`, optionally `LOCAL_RANK`): NCCL when CUDA is available (rank r on GPU `LOCAL_RANK`,
default r), gloo on CPUs. Rank 0 hosts the rendezvous store on `MASTER_ADDR:MASTER_PORT`, so the
same code spans hosts when that address is reachable from them.

Two groups, two timeouts:
- the default group carries the model's collectives (all-reduce, gather, scatter) and the
  tensors of each step, with `timeout_s` (default `COLLECTIVE_TIMEOUT_S`, 120 s): every rank
  runs the same forward, so a collective waits only for the slowest rank's share of one
  layer, and a rank that hangs fails the others after that long;
- a gloo `control` group carries rank 0's messages (`engine.parallel.messages`). Between steps
  the other ranks wait there for as long as the server idles, so its timeout is a year
  (`IDLE_TIMEOUT`).
A rank that dies closes its sockets: gloo fails the others' next collective or wait at once
("Connection closed by peer"), so a dead rank never leaves the others hanging.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel.messages import Stop

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0
IDLE_TIMEOUT = timedelta(days=365)
DRIVER = 0  # the rank that serves, schedules and sends every message
CHECK_IN = "dctl/joining/"  # + rank: a store key each other rank sets before it joins


@dataclass
class RankGroup:
    """This process's rank in a joined group, and the group's channels."""

    rank: int
    size: int
    backend: str  # of the default group: "nccl" or "gloo"
    device: torch.device  # where this rank keeps its weights and caches
    control: Any  # the gloo ProcessGroup of rank 0's messages
    # Held by rank 0 around each message and the collectives that follow it, so two threads
    # never interleave their collectives.
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_driver(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == DRIVER

    def send(self, message: object) -> None:
        """Rank 0: MESSAGE to every other rank (pickled; messages carry CPU tensors)."""
        if not self.is_driver:
            raise RuntimeError("only rank 0 sends messages")
        dist.broadcast_object_list([message], src=DRIVER, group=self.control)

    def receive(self) -> object:
        """Other ranks: the next message of rank 0 (waits as long as rank 0 idles)."""
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=DRIVER, group=self.control)
        return box[0]

    def gather_outcomes(self, outcome: str | None) -> list[str | None]:
        """Every rank's OUTCOME (None: fine, else its error), in rank order, on every rank."""
        outcomes: list[str | None] = [None] * self.size
        dist.all_gather_object(outcomes, outcome, group=self.control)
        return outcomes

    def close(self) -> None:
        """Rank 0: stops the other ranks (their `serve_worker` returns) and leaves; the other
        ranks: leave. A rank already gone only makes the stop fail, which is ignored."""
        if self.is_driver and self.control is not None:
            try:
                with self.lock:
                    self.send(Stop())
            except RuntimeError:
                pass
        self.leave()

    def leave(self) -> None:
        """Destroys the process groups (this rank's part of them); their sockets close, so
        ranks still waiting on this one fail at once."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self.control = None  # the last reference: the control group's sockets close now


def join_group(
    env: Mapping[str, str] | None = None,
    *,
    store: Any = None,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    backend: str | None = None,
) -> RankGroup:
    """Joins the group the torchrun-style ENV (default: os.environ) describes. STORE: rank 0's
    own rendezvous store, already listening (`engine.parallel.launcher`); else rank 0 opens one
    on MASTER_ADDR:MASTER_PORT and the others connect there. BACKEND: nccl or gloo (default:
    nccl when CUDA is available)."""
    env = os.environ if env is None else env
    rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if not 0 <= rank < size:
        raise ValueError(f"RANK {rank} is outside WORLD_SIZE {size}")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            env.get("MASTER_ADDR", "127.0.0.1"),
            _int(env, "MASTER_PORT"),
            size,
            is_master=rank == DRIVER,
            timeout=timeout,
            wait_for_workers=False,
        )
    if rank != DRIVER:
        store.set(f"{CHECK_IN}{rank}", "1")  # a launcher waiting for us knows we are up
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(env.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    log.info("rank joined", extra={"rank": rank, "size": size, "backend": backend})
    return RankGroup(rank, size, backend, device, control)


def _int(env: Mapping[str, str], key: str) -> int:
    value = env.get(key)
    if value is None or not value.strip().isdigit():
        raise ValueError(f"environment variable {key} must be a whole number, got {value!r}")
    return int(value)
