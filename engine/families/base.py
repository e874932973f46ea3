"""What a model family supplies to the shared engine: its runner.

The scheduler, continuous batching, slot admission, finish detection, streaming, the server and
the metrics are one for every family (`engine/core.py`, `engine/scheduler.py`). A family brings
the forwards and the decoding rule behind one interface: `FamilyRunner`. Its `decode` returns
plain `RequestResult`s in the shared vocabulary: offsets of the current block that became final
and their tokens. A masked family (SDAR) makes a few offsets final per step; a canvas family
(DiffusionGemma) makes the whole canvas final at the step it stops denoising, and until then
reports only its new private state (`RequestResult.state`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.params import SamplingParams
    from engine.runner import RequestResult
    from engine.scheduler import PrefillChunk, Request


class SlotCache(Protocol):
    """The preallocated per-slot K/V store a runner writes (sizes only, for metrics)."""

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one slot takes over all layers."""
        ...

    @property
    def bytes_total(self) -> int:
        """Bytes of the whole store."""
        ...


class FamilyRunner(Protocol):
    """One family's forwards and decoding rule over the shared slots and requests.

    The runner only reads requests; `EngineCore.update_from_output` applies its results.
    """

    family: str  # the family's name, as `dctl model create-demo --family` spells it
    cache: SlotCache
    block_size: int  # the default block (SDAR) or the canvas length (DiffusionGemma)
    # What `Request.open_block` fills not-yet-final positions with (SDAR: the mask token).
    placeholder_token_id: int
    # Whether prefill caches only whole prompt blocks (SDAR: the prompt's tail is the first
    # block's fixed part) or the whole prompt (DiffusionGemma: the canvas follows the prompt).
    aligned_prefill: bool
    # Whether a prompt must go to the cache in one forward, whatever the prefill budget: an
    # encoder whose prompt tokens attend to later ones computes other K/V when chunked.
    whole_prompt_prefill: bool

    def check_params(self, params: SamplingParams) -> None:
        """Refuse (InvalidParams naming the field) what this family cannot honour."""
        ...

    def start(self, request: Request) -> None:
        """Give a new request its family state (sampler, canvas) before it is queued."""
        ...

    def prefill(self, chunks: Sequence[PrefillChunk]) -> list[RequestResult]:
        """Write prompt chunks of equal length into their slots."""
        ...

    def decode(self, requests: Sequence[Request]) -> list[RequestResult]:
        """One denoising step for requests with the same block size and commit state."""
        ...
