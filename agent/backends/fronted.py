"""`python -m agent.backends.fronted --config FILE`: a `command` engine with the agent's front.

The supervisor starts this process in place of the engine, so a command engine behaves to it
exactly like the dctl engine: one process leading its own group, drained by SIGTERM, killed with
its group by SIGKILL, adopted after an agent restart by the config path on its command line. It
  - starts the engine's argv (already rendered) as its child, in its process group, with the
    environment the config adds (the API key's variable, when the engine reads one);
  - when the config has a `proxy`, serves the key-checking proxy (`key_proxy`) on the
    instance's address and port, the engine behind it on a loopback port;
  - turns the first SIGTERM (or SIGINT) into the engine's own drain signal, once, and keeps the
    proxy serving until the engine has exited, so requests it is finishing reach their clients;
  - exits with the engine's exit code (128 + N when signal N ended it).

The config file (0600, written by the agent) holds the key; nothing secret is on argv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

import uvicorn
import yaml

from agent.backends.key_proxy import KeyCheckingProxy
from runtime.logs import configure_logging
from runtime.parent_death import die_with_parent

log = logging.getLogger("dctl.agent.fronted")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process decides when the proxy stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def run(config: dict[str, Any]) -> int:
    """Run the engine (and its proxy) until the engine exits; its exit status."""
    env = {**os.environ, **config.get("env", {})}
    drain = signal.Signals[config.get("drain_signal", "SIGTERM")]
    # SIGKILL to the front alone (not its group) must not leave the engine behind: it gets its
    # drain signal when the front dies.
    child = await asyncio.create_subprocess_exec(
        *config["argv"], env=env, stdin=asyncio.subprocess.DEVNULL,
        preexec_fn=die_with_parent(drain),
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    draining = False

    def begin_drain() -> None:
        nonlocal draining
        if draining:
            return  # a second signal must not cut off what the engine is finishing
        draining = True
        log.info("draining: %s to the engine (pid %d)", drain.name, child.pid)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(drain)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, begin_drain)
    server = None
    serving = None
    proxy = config.get("proxy")
    if proxy is not None:
        app = KeyCheckingProxy(
            f"http://127.0.0.1:{proxy['upstream_port']}", proxy.get("api_key"), proxy["open_paths"]
        )
        server = _Server(
            uvicorn.Config(
                app,
                host=proxy["host"],
                port=int(proxy["port"]),
                log_level="warning",
                access_log=False,
                timeout_keep_alive=5,
                ssl_certfile=proxy.get("tls_cert"),
                ssl_keyfile=proxy.get("tls_key"),
                lifespan="on",
            )
        )
        serving = asyncio.create_task(server.serve())
    waiting = asyncio.create_task(child.wait())
    try:
        tasks = {waiting} if serving is None else {waiting, serving}
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():  # the proxy ended first (it could not listen): so does the engine
            log.error("the proxy stopped; stopping the engine")
            return 1
        return _status(waiting.result())
    finally:
        if child.returncode is None:  # the engine must not outlive its front
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
        if server is not None and serving is not None:
            server.should_exit = True
            with contextlib.suppress(BaseException):
                await serving


def _status(code: int) -> int:
    """An exit status for CODE: itself, or 128 + N for death by signal N."""
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    """Read the config, run, return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m agent.backends.fronted")
    parser.add_argument("--config", required=True, type=Path)
    args = parser.parse_args(argv)
    configure_logging("info", "kv")
    try:
        config = yaml.safe_load(args.config.read_text())
    except (OSError, yaml.YAMLError) as exc:
        print(f"cannot read {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(config))
    except FileNotFoundError as exc:
        print(f"cannot start the engine: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
