"""`python -m engine.serve --config engine.yaml`: the engine server process.

Start-up: read and validate the configuration (one line naming the bad key, exit 2), bind the
port at once so `/health/live` answers while the weights load in a background thread, then a
warm-up generation; only after it does `/health/ready` turn 200. SIGTERM (or Ctrl-C) drains:
readiness goes 503, new requests get 503, running ones finish within `shutdown_grace_s`, then
the process exits 0. A second signal exits at once.

With `parallel.size` N > 1 this process is rank 0 of the instance (`engine.serve_ranks`): the
loading thread checks the plan against the checkpoint, starts ranks 1..N-1 and builds the
split model through all of them; the warm-up runs on every rank, so ready means every rank
loaded. A rank that dies ends this process with exit code 1; a drain ends by stopping the
other ranks, each exiting 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from protocol.engine_config import FLAGS, ServeConfig, ServeConfigError, load_serve_config
from runtime.logs import configure_logging

if TYPE_CHECKING:
    from engine.factory import EngineOptions
    from engine.parallel.group import RankGroup
    from engine.serve_ranks import ServedRanks

log = logging.getLogger("engine.serve")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


# ---- arguments ---------------------------------------------------------------------------


def build_parser(prog: str = "python -m engine.serve") -> argparse.ArgumentParser:
    """`--config FILE` plus one flag per configuration key."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a block-diffusion checkpoint over an OpenAI-compatible HTTP API.",
    )
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument(
        "checkpoint", nargs="?", metavar="DIR", help="the checkpoint to serve (as --model DIR)"
    )
    for flag, key in FLAGS.items():
        parser.add_argument(f"--{flag}", dest=key, metavar="VALUE", help=f"overrides {key}")
    return parser


def read_config(argv: Sequence[str] | None, prog: str = "python -m engine.serve") -> ServeConfig:
    """Parse the command line into a validated configuration (ServeConfigError if bad)."""
    args = vars(build_parser(prog).parse_args(argv))
    path = args.pop("config")
    checkpoint = args.pop("checkpoint")
    if checkpoint is not None:
        if args.get("model.path") not in (None, checkpoint):
            raise ServeConfigError(
                f"model.path: the checkpoint is given twice ({checkpoint} and --model "
                f"{args['model.path']}); give one"
            )
        args["model.path"] = checkpoint
    overrides = {key: value for key, value in args.items() if value is not None}
    return load_serve_config(path, overrides)


# ---- model loading -----------------------------------------------------------------------


def engine_options(config: ServeConfig, ranks: int = 1) -> EngineOptions:
    """The `engine.factory.EngineOptions` this configuration asks for, for one of RANKS ranks
    (`engine.serve_ranks.rank_threads`)."""
    from engine.factory import EngineOptions
    from engine.serve_ranks import rank_threads

    m, svc, res = config.model, config.service, config.resources
    return EngineOptions(
        dtype=m.dtype,
        device=res.device,
        max_batch_size=svc.max_concurrent_requests,
        max_seq_len=m.max_seq_len,
        packed_weights=m.packed_weights,
        resident_weights=m.resident_weights,
        memory_fraction=res.memory_fraction,
        threads=rank_threads(config, ranks),
        track_experts=True,
        experts=config.parallel.experts,
    )


def load_served_model(config: ServeConfig, state: Any, group: RankGroup | None = None) -> Any:
    """Build the engine (`engine.factory`; split over GROUP's ranks when given), warm it up,
    start it; return the ServedModel."""
    from engine.api_requests import default_params
    from engine.async_engine import AsyncEngine
    from engine.errors import InvalidParams
    from engine.factory import build_engine
    from engine.serving import ServedModel

    m, svc = config.model, config.service
    ranks = group.size if group is not None else 1
    built = build_engine(m.path, engine_options(config, ranks), group=group)
    model, tokenizer, core = built.model, built.tokenizer, built.core
    default_block = m.block_size or core.default_block_size
    start = time.perf_counter()
    warm_prompt = tokenizer.encode("Hello") or [0]
    try:
        core.add_request("warm-up", warm_prompt, default_params(m, default_block, max_tokens=1))
    except InvalidParams as exc:
        if exc.field not in type(m).model_fields:
            raise
        # A default this checkpoint's family refuses (model.steps for a DiffusionGemma one, as
        # an SDAR deployment's config has) would refuse every request with a 400 blaming the
        # client, which gateways and rollouts do not count as errors: stop here instead.
        raise ServeConfigError(
            f"model.{exc.field} in the engine config is every request's default, and this "
            f"checkpoint refuses it: {exc}. Remove it (a rollout to this checkpoint can bring "
            "its own config: dctl rollout --engine-config FILE)"
        ) from exc
    while core.has_unfinished():
        core.step()
    log.info("warm-up done", extra={"seconds": round(time.perf_counter() - start, 3)})

    state.metrics.set_model_info(
        m.name,
        m.snapshot_digest,
        dtype=str(model.dtype).removeprefix("torch."),
        compute_dtype=str(model.compute_dtype).removeprefix("torch."),
        weights_layout=model.weights_layout,
        device=built.device,
        parallel_size=str(ranks),
        experts=config.parallel.experts,
    )
    state.metrics.parallel_ranks.set(ranks)
    state.metrics.kv_cache_total.set(core.kv_cache_bytes_total)
    state.metrics.max_queue.set(svc.max_queue)
    engine = AsyncEngine(
        core,
        state.metrics,
        max_running=svc.max_concurrent_requests,
        max_queue=svc.max_queue,
        model=model,
    )
    engine.start()
    return ServedModel(engine=engine, tokenizer=tokenizer, default_block=default_block)


# ---- the server --------------------------------------------------------------------------


def run(config: ServeConfig) -> int:
    """Serve until drained or failed; returns the process exit code."""
    import prometheus_client
    import uvicorn

    from engine.metrics import EngineMetrics
    from engine.server import create_app
    from engine.serving import ServerState

    # `_created` samples only double the scrape size; nothing here charts them.
    prometheus_client.disable_created_metrics()
    state = ServerState(config=config, metrics=EngineMetrics())
    exit_code = EXIT_OK
    ranks: ServedRanks | None = None  # the instance's other ranks, when it has several

    class EngineServer(uvicorn.Server):
        """uvicorn, with SIGTERM meaning 'drain' instead of 'close the socket now'."""

        loop: asyncio.AbstractEventLoop | None = None
        drain_started = False
        drain_task: asyncio.Task[None] | None = None  # held: the loop keeps tasks only weakly

        def start_drain(self) -> None:
            if self.loop is not None:
                self.drain_task = self.loop.create_task(drain())

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.drain_started or state.model is None or self.loop is None:
                # Second signal, or nothing to drain yet: stop now.
                self.should_exit = True
                if self.drain_started:
                    self.force_exit = True
                return
            self.drain_started = True
            state.draining = True
            self.loop.call_soon_threadsafe(self.start_drain)

        async def startup(self, sockets: list[Any] | None = None) -> None:
            await super().startup(sockets)
            if not self.should_exit:
                scheme = "https" if config.service.tls_cert else "http"
                log.info(
                    "listening",
                    extra={
                        "address": f"{scheme}://{config.service.host}:{config.service.port}",
                        "model": config.model.name,
                    },
                )

    async def drain() -> None:
        grace = config.service.shutdown_grace_s
        model = state.model
        log.info("draining", extra={"in_flight": state.answering, "grace_s": grace})
        # Every request taken before the signal (streamed or not, in the engine or still being
        # read or tokenized: new ones are refused at the door, `require_ready`) has the grace
        # period to be answered in full. Once uvicorn shuts down it cancels whatever still
        # runs, and a cancelled handler is a 500 to its client. The engine's own count would
        # not do: it starts after a request is read and ends before its answer is written.
        deadline = time.monotonic() + grace
        while state.answering and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Past the grace: what the engine still holds fails as 503 `draining`, which gateways
        # retry elsewhere (uvicorn's `timeout_graceful_shutdown` lets those answers out).
        aborted = await model.engine.drain(0) if model is not None else 0
        log.info("drained", extra={"aborted": aborted})
        server.should_exit = True

    def load_in_background(loop: asyncio.AbstractEventLoop) -> None:
        nonlocal exit_code, ranks
        from engine.serve_ranks import start_ranks

        try:
            ranks = start_ranks(config)
            group = ranks.local.group if ranks is not None else None
            state.model = load_served_model(config, state, group)
            log.info("ready", extra={"model": config.model.name})
        except Exception as exc:
            state.failure = f"{type(exc).__name__}: {exc}"
            log.error("model load failed", extra={"error": state.failure})
            exit_code = EXIT_FAILED
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        server.loop = loop
        threading.Thread(
            target=load_in_background, args=(loop,), name="model-load", daemon=True
        ).start()
        yield
        if state.model is not None:
            state.model.engine.shutdown()
        if ranks is not None:
            ranks.close()  # after the engine's last step: the other ranks exit 0

    app = create_app(state)
    app.router.lifespan_context = lifespan
    uv_config = uvicorn.Config(
        app,
        host=config.service.host,
        port=config.service.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
        lifespan="on",
        # Checked with the config (protocol.engine_config); None serves plain HTTP.
        ssl_certfile=config.service.tls_cert,
        ssl_keyfile=config.service.tls_key,
    )
    server = EngineServer(uv_config)
    server.run()
    if server.started is False and exit_code == EXIT_OK:
        exit_code = EXIT_FAILED  # could not bind the port (uvicorn logged why)
    return exit_code


def log_start(config: ServeConfig) -> None:
    """The first log line: this process and its whole configuration. The API key in it is
    redacted by the project's formatters (`runtime.logs`), like every secret of every line."""
    log.info("starting", extra={"pid": os.getpid(), "config": config.model_dump(mode="json")})
    if config.chaos.active:
        # Loud on purpose: an engine that fails requests on purpose must never go unnoticed.
        log.warning(
            "chaos is on: requests fail or slow down on purpose", extra=config.chaos.model_dump()
        )


def main(argv: Sequence[str] | None = None, prog: str = "python -m engine.serve") -> int:
    """Entry point of `python -m engine.serve` and `dctl engine serve`."""
    try:
        config = read_config(argv, prog)
    except ServeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(config.logging.level, config.logging.format)
    log_start(config)
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
