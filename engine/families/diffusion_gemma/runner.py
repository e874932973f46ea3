"""DiffusionGemma in the shared engine: encoder prefill, canvas denoising, commits.

A request's life in the shared scheduler: its whole prompt is encoded into its slot (prefill);
then each denoising step runs the decoder over its canvas against the slot, and the rules of
`sampling.denoising_step` decide the next canvas. While a canvas denoises, the step's result
carries only the request's new `CanvasState`; the step that stops it (stable and confident, or
the last allowed) makes the whole canvas final at once (its argmax), and the shared core then
does what it does for every family: finish detection (EOS, stop strings, max_tokens), streaming,
and the commit. The commit is an encoder forward of the final canvas into the slot, run at the
start of the request's next step (the reference encodes it before the next canvas's noise).

Every request draws from its own generator in the reference's order (canvas noise, then per
step a draw per position and a canvas of renoise), so a request's tokens do not depend on the
batch, and at batch 1 with a seed they are `transformers`' `generate()` tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.errors import InvalidParams
from engine.families.diffusion_gemma.decoding_config import DiffusionGemmaDecoding
from engine.families.diffusion_gemma.kv import EncoderKV
from engine.families.diffusion_gemma.model import DiffusionGemmaModel
from engine.families.diffusion_gemma.sampling import (
    CanvasStability,
    denoising_step,
    initial_canvas,
)
from engine.params import MAX_SEED, SamplingParams
from engine.runner import RequestResult
from engine.scheduler import PrefillChunk, Request
from engine.tokenizer import Tokenizer

FAMILY = "diffusion-gemma"
# SamplingParams fields that belong to masked decoding, with the value that means "unset".
_MASKED_ONLY = {
    "threshold": 0.9,
    "steps": None,
    "min_steps": 1,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
}


@dataclass(frozen=True)
class CanvasState:
    """One request's decoding state: its settings, its random stream, its canvas in flight.

    `canvas` is None between canvases: the next step starts a new one from noise.
    """

    decoding: DiffusionGemmaDecoding
    generator: torch.Generator
    canvas: torch.Tensor | None = None  # (C,) the decoder's next input
    self_conditioning: torch.Tensor | None = None  # (C, V) the previous step's scaled logits
    stability: CanvasStability = field(default_factory=CanvasStability)
    steps: int = 0  # denoising steps taken on this canvas


class DiffusionGemmaRunner:
    """The DiffusionGemma family's `FamilyRunner`."""

    family = FAMILY
    aligned_prefill = False  # the whole prompt is encoded; canvases follow it

    def __init__(self, model: DiffusionGemmaModel, cache: EncoderKV, *, vocab_size: int) -> None:
        config = model.config
        self.model = model
        self.cache = cache
        self.vocab_size = vocab_size
        self.block_size = config.canvas_length
        self.decoding = config.decoding
        # Never read: a canvas's tokens live in its CanvasState until it is final.
        self.placeholder_token_id = config.pad_token_id or 0
        # A bidirectional encoder's prompt tokens attend to later ones: no chunking.
        self.whole_prompt_prefill = config.bidirectional_encoder
        self.device = model.device

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def check_params(self, params: SamplingParams) -> None:
        """Refuse the masked-decoding knobs and any block size but the canvas length."""
        for name, unset in _MASKED_ONLY.items():
            if getattr(params, name) != unset:
                raise InvalidParams(
                    name,
                    f"{name} is a masked-diffusion setting; the {FAMILY} family samples a "
                    "uniform-noise canvas under an entropy bound: leave it unset",
                )
        if params.block_size is not None and params.block_size != self.block_size:
            raise InvalidParams(
                "block_size",
                f"block_size is the checkpoint's canvas length ({self.block_size}) for the "
                f"{FAMILY} family; leave it unset, got {params.block_size!r}",
            )
        self.request_decoding(params)  # range errors name the field now, not at the first step

    def request_decoding(self, params: SamplingParams) -> DiffusionGemmaDecoding:
        """The checkpoint's decoding with the request's settings: `max_steps` caps the steps of
        a canvas; a `temperature` above 0 scales the temperature schedule (1 keeps it)."""
        overrides: dict[str, object] = {}
        if params.max_steps is not None:
            overrides["max_denoising_steps"] = params.max_steps
        if params.temperature > 0:
            overrides["t_min"] = self.decoding.t_min * params.temperature
            overrides["t_max"] = self.decoding.t_max * params.temperature
        try:
            return self.decoding.with_overrides(**overrides)
        except InvalidParams as exc:
            # Name the request's field, not the checkpoint's.
            name = "max_steps" if exc.field == "max_denoising_steps" else "temperature"
            raise InvalidParams(name, f"{name}: {exc}") from exc

    def start(self, request: Request) -> None:
        """The request's decoding settings and its random stream (seeded, or fresh)."""
        params = request.params
        generator = torch.Generator(device=self.device)
        generator.manual_seed(secrets.randbelow(MAX_SEED) if params.seed is None else params.seed)
        request.state = CanvasState(decoding=self.request_decoding(params), generator=generator)

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> list[RequestResult]:
        """Encode prompt chunks of equal length into their slots."""
        length = chunks[0].length
        ids = [c.request.prompt_ids[c.start : c.start + length] for c in chunks]
        self.model.encode_into(
            self.cache,
            torch.tensor(ids, dtype=torch.long, device=self.device),
            self._long([c.request.slot for c in chunks]),
            self._long([c.start for c in chunks]),
        )
        return [RequestResult(c.request.request_id, prefilled=length) for c in chunks]

    @torch.inference_mode()
    def decode(self, requests: Sequence[Request]) -> list[RequestResult]:
        """One denoising step of every request's canvas (committing finished ones first)."""
        states: list[CanvasState] = [r.state for r in requests]
        slots = self._long([r.slot for r in requests])
        committing = [i for i, r in enumerate(requests) if r.pending_commit is not None]
        if committing:
            self.model.encode_into(
                self.cache,
                self._long([t for i in committing for t in requests[i].pending_commit or []]).view(
                    len(committing), self.block_size
                ),
                slots[committing],
                self._long([requests[i].committed for i in committing]),
            )
        # A canvas that starts now draws its noise first, as the reference does.
        canvases = [
            s.canvas
            if s.canvas is not None
            else initial_canvas([s.generator], self.block_size, self.vocab_size)[0]
            for s in states
        ]
        canvas = torch.stack(canvases).to(self.device)
        conditioned = [s.self_conditioning is not None for s in states]
        sc_logits = None
        if any(conditioned):
            blank = torch.zeros(self.block_size, self.vocab_size, device=self.device)
            sc_logits = torch.stack(
                [blank if s.self_conditioning is None else s.self_conditioning for s in states]
            )
        logits = self.model.denoise_batch(
            self.cache,
            canvas,
            slots,
            self._long([r.block_start for r in requests]),
            sc_logits,
            torch.tensor(conditioned, device=self.device) if sc_logits is not None else None,
        )
        decided = denoising_step(
            logits,
            canvas,
            decodings=[s.decoding for s in states],
            steps_taken=[s.steps for s in states],
            generators=[s.generator for s in states],
            stability=[s.stability for s in states],
        )
        results = []
        for i, (request, state) in enumerate(zip(requests, states, strict=True)):
            committed = request.pending_commit is not None
            if decided.finished[i]:
                results.append(
                    RequestResult(
                        request.request_id,
                        committed_block=committed,
                        denoised=True,
                        unmasked=tuple(range(self.block_size)),
                        tokens=tuple(decided.argmax_canvas[i].tolist()),
                        state=CanvasState(decoding=state.decoding, generator=state.generator),
                    )
                )
                continue
            following = replace(
                state,
                canvas=decided.next_canvas[i],
                self_conditioning=decided.self_conditioning_logits[i],
                stability=decided.stability[i],
                steps=state.steps + 1,
            )
            results.append(
                RequestResult(
                    request.request_id, committed_block=committed, denoised=True, state=following
                )
            )
        return results


def build_runner(
    model: DiffusionGemmaModel, tokenizer: Tokenizer, *, max_batch_size: int, max_seq_len: int
) -> DiffusionGemmaRunner:
    """A canvas runner over a fresh encoder K/V store of MAX_BATCH_SIZE slots."""
    # The canvas draws from the model's whole vocabulary, as the reference does; a tokenizer
    # smaller than it decodes unknown ids as nothing.
    del tokenizer
    return DiffusionGemmaRunner(
        model, model.new_kv(max_batch_size, max_seq_len), vocab_size=model.config.vocab_size
    )
