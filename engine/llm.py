"""`LLM`: offline batch generation in-process (load a checkpoint, generate, done).

The engine is built by `engine.factory.build_engine`, as the server's and the tuner's are.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.core import RequestStats
from engine.errors import InvalidParams
from engine.factory import BuiltEngine, EngineOptions, build_engine
from engine.packing import PackPolicy
from engine.params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats | None = None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [items]  # type: ignore[list-item]
    for p in items:
        if not isinstance(p, str | list):
            raise InvalidParams(
                "prompts", f"a prompt must be a string or a list of token ids, got {type(p)}"
            )
    return items  # type: ignore[return-value]


class LLM:
    """A checkpoint loaded in-process, with an EngineCore to batch its requests."""

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
        max_batch_size: int = 16,
        max_seq_len: int = 4096,
        packed_weights: PackPolicy = "auto",
    ) -> None:
        options = EngineOptions(
            dtype=dtype,
            device=device,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            packed_weights=packed_weights,
        )
        self.engine: BuiltEngine = build_engine(path, options)
        self.model = self.engine.model
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self.core = self.engine.core
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (all batched together); outputs in prompt order."""
        items = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(items)
        else:
            per_prompt = list(params)
            if len(per_prompt) != len(items):
                raise InvalidParams(
                    "params",
                    f"got {len(per_prompt)} SamplingParams for {len(items)} prompts; "
                    "pass one for all or one per prompt",
                )
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        return self._run(token_lists, per_prompt)

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations: list[list[dict[str, Any]]] = (
            [messages] if single else list(messages)  # type: ignore[list-item,arg-type]
        )
        if params is None or isinstance(params, SamplingParams):
            per_prompt = [params or SamplingParams()] * len(conversations)
        else:
            per_prompt = list(params)
        prompts: list[Prompt] = [
            self.tokenizer.encode_chat(conv, enable_thinking=p.thinking)
            for conv, p in zip(conversations, per_prompt, strict=True)
        ]
        return self.generate(prompts, per_prompt)

    def _run(
        self, token_lists: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        order = []
        try:
            for ids, p in zip(token_lists, params, strict=True):
                request_id = f"llm-{next(self._ids)}"
                # Validation happens here, before anything runs: a bad request fails the call.
                self.core.add_request(request_id, ids, p)
                outputs[request_id] = RequestOutput(request_id, ids)
                order.append(request_id)
            while self.core.has_unfinished():
                for update in self.core.step():
                    out = outputs[update.request_id]
                    out.token_ids.extend(update.new_token_ids)
                    out.text += update.text_delta
                    if update.finished:
                        out.finish_reason = update.finish_reason
                        out.stats = update.stats
        except BaseException:
            for request_id in order:
                self.core.abort_request(request_id)
            while self.core.has_unfinished():
                self.core.step()
            raise
        return [outputs[r] for r in order]
