"""Is the engine an instance asks for installed where the agent would start it, and which version?

Checked before every start of a vLLM, SGLang or command instance. A missing engine fails the
instance with a message naming what to install (the state `failed`, which no restart fixes),
instead of a process that dies at once and crash-loops. Answers are kept a minute, so the check
costs one short subprocess per interpreter per minute, and an engine installed meanwhile is
found at the next start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.engine_kinds import CommandEngine, EngineChoice, ServerEngine

CACHE_S = 60.0
PROBE_TIMEOUT_S = 30.0
# Prints the distribution's version, or exits 3 when the module is not importable there.
# Reads metadata only: importing vLLM itself takes seconds and initialises CUDA.
_VERSION_OF = (
    "import importlib.metadata as m, importlib.util as u, sys\n"
    "name = sys.argv[1]\n"
    "if u.find_spec(name) is None: sys.exit(3)\n"
    "print(m.version(name))\n"
)
Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Presence:
    """The answer for one engine: found (with what was found) or missing (with the fix)."""

    found: bool
    text: str


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


class EnginePresence:
    """Finds engines: modules in an interpreter's environment, programs on the PATH."""

    def __init__(
        self,
        python: str,
        path: str | None = None,
        runner: Runner = _run,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._python = python
        self._path = path if path is not None else os.environ.get("PATH", os.defpath)
        self._runner = runner
        self._clock = clock
        self._cache: dict[tuple[str, str], tuple[float, Presence]] = {}

    def check(self, engine: EngineChoice) -> Presence | None:
        """What was found for ENGINE; None for the dctl engine (it is the agent's own)."""
        if isinstance(engine, ServerEngine):
            return self._cached((engine.python or self._python, engine.kind), self._module)
        if isinstance(engine, CommandEngine):
            return self._cached(("", engine.command[0]), self._program)
        return None

    def _cached(self, key: tuple[str, str], find: Callable[[str, str], Presence]) -> Presence:
        now = self._clock()
        hit = self._cache.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1]
        answer = find(*key)
        self._cache[key] = (now, answer)
        return answer

    def _module(self, python: str, module: str) -> Presence:
        package = "vllm" if module == "vllm" else "sglang[all]"
        install = f"install it there ({python} -m pip install {package})"
        try:
            done = self._runner([python, "-c", _VERSION_OF, module])
        except FileNotFoundError:
            return Presence(False, f"no Python interpreter at {python} (engine.python)")
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Presence(False, f"cannot ask {python} for {module}: {exc}")
        if done.returncode == 3:
            return Presence(
                False,
                f"{module} is not installed for {python}: {install}, or set engine.python to "
                "the interpreter of an environment that has it",
            )
        if done.returncode != 0:
            tail = (done.stderr or "").strip().splitlines()[-1:] or ["no output"]
            return Presence(False, f"cannot read {module}'s version with {python}: {tail[0]}")
        return Presence(True, f"{module} {done.stdout.strip()} ({python})")

    def _program(self, _unused: str, program: str) -> Presence:
        found = shutil.which(program, path=self._path)
        if found is None:
            where = "is not executable" if os.sep in program else "is not on the agent's PATH"
            return Presence(
                False,
                f"engine.command[0] {program!r} {where}: install it on this host, or give its "
                "absolute path",
            )
        return Presence(True, found)
