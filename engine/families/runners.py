"""The runner of a loaded model's family: the one place the engine looks a family up.

A model class names its family (`family` class attribute); each family module has a
`build_runner(model, tokenizer, *, max_batch_size, max_seq_len)`. Imported lazily, so serving
one family never imports another's modules.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.errors import EngineError
from engine.families.base import FamilyRunner
from engine.tokenizer import Tokenizer

# family name -> the module whose `build_runner` makes its runner
RUNNER_MODULES = {
    "sdar": "engine.families.sdar",
    "diffusion-gemma": "engine.families.diffusion_gemma.runner",
}


def build_runner(
    model: Any, tokenizer: Tokenizer, *, max_batch_size: int, max_seq_len: int
) -> FamilyRunner:
    """The runner that decodes with MODEL, over a cache of MAX_BATCH_SIZE slots."""
    family = getattr(model, "family", None)
    module = RUNNER_MODULES.get(family) if isinstance(family, str) else None
    if module is None:
        raise EngineError(
            f"{type(model).__name__} names no model family the engine serves "
            f"(known: {', '.join(RUNNER_MODULES)})"
        )
    runner: FamilyRunner = importlib.import_module(module).build_runner(
        model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len
    )
    return runner
