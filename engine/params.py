"""Per-request decoding parameters and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import ContextLengthExceeded, InvalidParams

# torch.Generator.manual_seed takes a 64-bit value; keep seeds in the range every backend accepts.
MAX_SEED = 2**63 - 1


def padded_length(prompt_len: int, max_tokens: int, block_size: int) -> int:
    """Sequence length a request occupies: prompt + max_tokens, rounded up to whole blocks."""
    return math.ceil((prompt_len + max_tokens) / block_size) * block_size


def _is_int(value: object) -> bool:
    # bool is an int subclass; `max_tokens=True` is a caller bug, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass
class SamplingParams:
    """How one request is decoded: length, sampling, stops and the unmasking schedule.

    `block_size=None` uses the checkpoint's block size. `steps=None` selects threshold mode
    (accept every masked position whose confidence reaches `threshold`, at least one per step);
    `steps=S` selects steps mode (the block finishes in exactly S steps). `min_steps` and
    `max_steps` bound the number of denoising steps of a block. `thinking` switches the chat
    template's thinking mode (None leaves the template's default).

    The vLLM-style extensions: `ignore_eos` decodes past EOS (exactly `max_tokens` tokens
    unless a stop string or stop token ends it); `min_tokens` forbids EOS and the stop tokens
    at the first `min_tokens` positions and counts no stop string that ends before them;
    `min_p` drops tokens less likely than min_p times the most likely one (from the draw);
    `stop_token_ids` end the request like EOS (the token is not part of the output);
    `skip_special_tokens=False` keeps special tokens in the text.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    block_size: int | None = None
    threshold: float = 0.9
    steps: int | None = None
    min_steps: int = 1
    max_steps: int | None = None
    thinking: bool | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def stop_strings(self) -> list[str]:
        """The stop strings as a list (a single string is accepted as one stop)."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)

    def resolved_block_size(self, default_block: int) -> int:
        """The block size this request decodes with."""
        return default_block if self.block_size is None else self.block_size

    def validate(self, max_seq_len: int, prompt_len: int, default_block: int) -> None:
        """Raise InvalidParams naming the field and its allowed range, or ContextLengthExceeded."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidParams(
                "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidParams(
                "temperature",
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}",
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParams("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidParams(
                "top_k", f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidParams(
                "seed", f"seed must be null or an integer in [0, {MAX_SEED}], got {self.seed!r}"
            )
        self._validate_stop()
        self._validate_extensions()
        block = self.resolved_block_size(default_block)
        if not _is_int(block) or not 1 <= block <= max_seq_len:
            raise InvalidParams(
                "block_size",
                f"block_size must be null (checkpoint default {default_block}) or an integer "
                f"in [1, {max_seq_len}], got {self.block_size!r}",
            )
        if not _is_number(self.threshold) or not 0 < self.threshold <= 1:
            raise InvalidParams("threshold", f"threshold must be in (0, 1], got {self.threshold!r}")
        if self.steps is not None and (not _is_int(self.steps) or not 1 <= self.steps <= block):
            raise InvalidParams(
                "steps",
                f"steps must be null (threshold mode) or an integer in [1, block_size={block}], "
                f"got {self.steps!r}",
            )
        if not _is_int(self.min_steps) or not 1 <= self.min_steps <= block:
            raise InvalidParams(
                "min_steps",
                f"min_steps must be an integer in [1, block_size={block}], got {self.min_steps!r}",
            )
        if self.max_steps is not None and (
            not _is_int(self.max_steps) or not self.min_steps <= self.max_steps
        ):
            raise InvalidParams(
                "max_steps",
                f"max_steps must be null or an integer >= min_steps={self.min_steps}, "
                f"got {self.max_steps!r}",
            )
        if self.thinking is not None and not isinstance(self.thinking, bool):
            raise InvalidParams(
                "thinking", f"thinking must be null, true or false, got {self.thinking!r}"
            )
        if prompt_len < 1:
            raise InvalidParams("prompt", "the prompt must contain at least one token")
        needed = padded_length(prompt_len, self.max_tokens, block)
        if needed > max_seq_len:
            raise ContextLengthExceeded(limit=max_seq_len, requested=needed)

    def _validate_extensions(self) -> None:
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidParams(
                "min_tokens",
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidParams("min_p", f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        ids = self.stop_token_ids or []
        if not isinstance(ids, list) or any(not _is_int(t) or t < 0 for t in ids):
            raise InvalidParams(
                "stop_token_ids", f"stop_token_ids must be token ids (integers >= 0), got {ids!r}"
            )
        for flag in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidParams(flag, f"{flag} must be true or false")

    def _validate_stop(self) -> None:
        stops = self.stop
        if stops is None or isinstance(stops, str):
            stops = [] if stops is None else [stops]
        elif not isinstance(stops, list):
            raise InvalidParams(
                "stop", f"stop must be null, a string or a list of strings, got {stops!r}"
            )
        for item in stops:
            if not isinstance(item, str) or not item:
                raise InvalidParams("stop", f"every stop string must be non-empty, got {item!r}")
