"""The SDAR / Qwen3-MoE family: masked block diffusion over a block-causal transformer.

Its modules are the engine's first ones (`engine/config.py`, `engine/model.py`,
`engine/loader.py`, `engine/runner.py`, `engine/decoding.py`, `engine/sampling.py`); this module
builds its runner for the shared engine core.
"""

from __future__ import annotations

from engine.errors import EngineError
from engine.kv_cache import KVCache
from engine.model import Model
from engine.runner import ModelRunner
from engine.tokenizer import Tokenizer


def build_runner(
    model: Model, tokenizer: Tokenizer, *, max_batch_size: int, max_seq_len: int
) -> ModelRunner:
    """A masked-diffusion runner over a fresh KV cache of MAX_BATCH_SIZE slots."""
    config = model.config
    mask_id = config.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise EngineError(
            f"the checkpoint ({config.model_type}) names no mask token, so it cannot run "
            "block-diffusion decoding; set mask_token_id in config.json"
        )
    cache = KVCache(config, max_batch_size, max_seq_len, dtype=model.dtype, device=model.device)
    return ModelRunner(
        model,
        cache,
        mask_token_id=mask_id,
        vocab_limit=min(tokenizer.vocab_size, config.vocab_size),
    )
