"""The ranks other than 0: load, run and drop what rank 0's messages say, until it stops them.

`python -m engine.parallel.worker` is one such rank, joined from the torchrun-style environment
(`engine.parallel.group`); `engine.parallel.launcher` starts them for a group on this machine,
and an agent may start them itself. The process exits 0 when rank 0 stops the group, 1 when
anything fails (a dead or hung peer, a failed forward): a forward that fails on one rank leaves
the others out of step, so the whole group must restart.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.parallel.group import RankGroup, join_group
from engine.parallel.loading import load_rank_model
from engine.parallel.messages import Call, LoadShard, PackWeights, ReleaseModel, Stop, describe
from runtime.logs import configure_logging

log = logging.getLogger(__name__)

# torch's CPU threads per rank (N ranks on one machine share its cores); else torch's default.
THREADS_ENV = "DCTL_RANK_THREADS"
# The rank's log level and format (`runtime.logs`: json or kv); info and kv by default.
LOG_LEVEL_ENV, LOG_FORMAT_ENV = "DCTL_RANK_LOG_LEVEL", "DCTL_RANK_LOG_FORMAT"


@dataclass
class _Held:
    """A model this rank holds, and its parts of rank 0's caches by number."""

    model: Any
    caches: dict[int, Any] = field(default_factory=dict)


def serve_worker(group: RankGroup) -> None:
    """Runs rank 0's messages on this rank until `Stop` (returns) or a failure (raises)."""
    if group.is_driver:
        raise RuntimeError("rank 0 drives the model; serve_worker is for the other ranks")
    held: dict[int, _Held] = {}
    while True:
        message = group.receive()
        if isinstance(message, Stop):
            return
        if isinstance(message, Call):
            model = held[message.model]
            for number in message.released:
                model.caches.pop(number, None)
            cache = None
            if message.cache is not None:
                cache = model.caches.get(message.cache.number)
                if cache is None:
                    cache = model.caches[message.cache.number] = message.cache.allocate(model.model)
            with torch.inference_mode():
                message.forward.run(model.model, cache, None)
        elif isinstance(message, LoadShard):
            outcome = None
            try:
                loaded = load_rank_model(
                    message.path,
                    message.plan.share(group.rank),
                    device=group.device,
                    dtype=message.dtype,
                    compute_dtype=message.compute_dtype,
                )
                held[message.model] = _Held(loaded.model)
            except Exception as exc:  # rank 0 reports it; this rank stays in the group
                log.warning("shard not loaded", extra={"rank": group.rank, "error": str(exc)})
                outcome = describe(exc)
            group.gather_outcomes(outcome)
        elif isinstance(message, ReleaseModel):
            held.pop(message.model, None)
        elif isinstance(message, PackWeights):
            held[message.model].model.pack_weights(message.scope)
        else:
            raise RuntimeError(f"rank {group.rank}: unknown message {type(message).__name__}")


def run_rank(env: dict[str, str]) -> None:
    """A launcher's worker process: `main` under ENV (the torchrun-style variables), exiting
    with its code. (Forked from a server process that imported torch once, the worker gets
    the variables here rather than from its parent's environment.)"""
    os.environ.update(env)
    code = main()
    logging.shutdown()
    sys.exit(code)


def main() -> int:
    """One rank > 0 of a group described by the environment; the process's exit code."""
    configure_logging(os.environ.get(LOG_LEVEL_ENV, "info"), os.environ.get(LOG_FORMAT_ENV, "kv"))
    threads = os.environ.get(THREADS_ENV)
    if threads:
        torch.set_num_threads(int(threads))
    group = join_group()
    try:
        serve_worker(group)
    except Exception:
        log.exception("rank failed; the group must restart", extra={"rank": group.rank})
        return 1
    group.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
