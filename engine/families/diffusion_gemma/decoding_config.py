"""DiffusionGemma's decoding settings: what `generation_config.json` says, else the reference's
defaults (`DiffusionGemmaGenerationConfig`, transformers 5.24), and per-request overrides.

Importable without torch. The ranges are the reference's: `max_denoising_steps` >= 1,
`0 <= t_min < t_max`, `entropy_bound` > 0, `stability_threshold` >= 0 (0: every canvas counts
as stable), `confidence_threshold` > 0. A bad value in the file is a `CheckpointError` naming
the file and the field; a bad override is an `InvalidParams` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import CheckpointError, InvalidParams

# The sampler class the reference stores in `sampler_config._cls_name`; the only one it has.
ENTROPY_BOUND_SAMPLER = "EntropyBoundSamplerConfig"

# Reference defaults (DiffusionGemmaGenerationConfig._get_default_generation_params).
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_MAX_DENOISING_STEPS = 48
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_T_MIN = 0.4
DEFAULT_T_MAX = 0.8
DEFAULT_STABILITY_THRESHOLD = 1
DEFAULT_CONFIDENCE_THRESHOLD = 0.005

# field -> (kind, lower bound, whether the bound itself is allowed)
_RANGES: dict[str, tuple[str, float, bool]] = {
    "canvas_length": ("int", 1, True),
    "max_new_tokens": ("int", 1, True),
    "max_denoising_steps": ("int", 1, True),
    "stability_threshold": ("int", 0, True),
    "entropy_bound": ("number", 0.0, False),
    "t_min": ("number", 0.0, True),
    "t_max": ("number", 0.0, True),
    "confidence_threshold": ("number", 0.0, False),
}
# The per-request overrides `with_overrides` takes (the canvas is the checkpoint's).
OVERRIDABLE = (
    "max_new_tokens",
    "max_denoising_steps",
    "entropy_bound",
    "t_min",
    "t_max",
    "stability_threshold",
    "confidence_threshold",
    "eos_token_ids",
)


@dataclass(frozen=True)
class DiffusionGemmaDecoding:
    """How one DiffusionGemma request is decoded, canvas by canvas.

    - `canvas_length`: tokens per canvas (the block); fixed by the checkpoint.
    - `max_denoising_steps` (N): a canvas stops after N steps at the latest.
    - `t_min`, `t_max`: the linear temperature schedule; step k of N (k = 1..N) runs at
      t_min + (t_max - t_min) * (N - k + 1) / N, so t_max first, never quite t_min.
    - `entropy_bound`: a step accepts its lowest-entropy tokens while sum(H) - max(H) stays
      within this bound (always at least one).
    - `stability_threshold`, `confidence_threshold`: a canvas stops early once its argmax has
      not changed for `stability_threshold` steps and its mean token entropy is below
      `confidence_threshold`.
    - `max_new_tokens`: the default when a request names no limit.
    - `eos_token_ids`: a canvas holding any of them is the last; `pad_token_id` is what the
      reference writes after the first EOS (None: it writes nothing).
    """

    canvas_length: int
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_denoising_steps: int = DEFAULT_MAX_DENOISING_STEPS
    entropy_bound: float = DEFAULT_ENTROPY_BOUND
    t_min: float = DEFAULT_T_MIN
    t_max: float = DEFAULT_T_MAX
    stability_threshold: int = DEFAULT_STABILITY_THRESHOLD
    confidence_threshold: float = DEFAULT_CONFIDENCE_THRESHOLD
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        problem = _first_problem(dataclasses.asdict(self))
        if problem is not None:
            raise InvalidParams(*problem)

    @classmethod
    def from_generation_config(
        cls,
        gen: Mapping[str, Any] | None,
        *,
        canvas_length: int,
        source: str,
        fallback_eos_token_ids: Sequence[int] = (),
        fallback_pad_token_id: int | None = None,
    ) -> DiffusionGemmaDecoding:
        """The decoding a `generation_config.json` dict describes (None: no file), reference
        defaults for what it leaves out or sets to null.

        `canvas_length` is config.json's; the fallback ids (config.json's text_config values)
        apply when the file names no `eos_token_id` / `pad_token_id`. SOURCE names the file in
        errors: a bad value is a CheckpointError naming the file and the field.
        """
        data: Mapping[str, Any] = {} if gen is None else gen
        if not isinstance(data, Mapping):
            raise CheckpointError(f"{source}: must hold a JSON object, got {data!r}")
        sampler = data.get("sampler_config")
        if sampler is None:
            sampler = {}
        if not isinstance(sampler, Mapping):
            raise CheckpointError(f"{source}: field 'sampler_config' must be an object")
        sampler_class = sampler.get("_cls_name", ENTROPY_BOUND_SAMPLER)
        if sampler_class != ENTROPY_BOUND_SAMPLER:
            raise CheckpointError(
                f"{source}: field 'sampler_config._cls_name' is {sampler_class!r}; the only "
                f"sampler DiffusionGemma has is {ENTROPY_BOUND_SAMPLER!r}"
            )

        def value(key: str, default: Any, where: Mapping[str, Any] = data) -> Any:
            found = where.get(key)
            return default if found is None else found

        eos = value("eos_token_id", list(fallback_eos_token_ids))
        pad = data.get("pad_token_id", fallback_pad_token_id)
        values: dict[str, Any] = {
            "canvas_length": canvas_length,
            "max_new_tokens": value("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
            "max_denoising_steps": value("max_denoising_steps", DEFAULT_MAX_DENOISING_STEPS),
            "entropy_bound": value("entropy_bound", DEFAULT_ENTROPY_BOUND, sampler),
            "t_min": value("t_min", DEFAULT_T_MIN),
            "t_max": value("t_max", DEFAULT_T_MAX),
            "stability_threshold": value("stability_threshold", DEFAULT_STABILITY_THRESHOLD),
            "confidence_threshold": value("confidence_threshold", DEFAULT_CONFIDENCE_THRESHOLD),
            "eos_token_ids": eos if isinstance(eos, list) else [eos],
            "pad_token_id": pad,
        }
        problem = _first_problem(values)
        if problem is not None:
            field, message = problem
            raise CheckpointError(f"{source}: field '{_file_name(field)}' {message}")
        return cls(**_normalised(values))

    def with_overrides(self, **fields: Any) -> DiffusionGemmaDecoding:
        """A copy with one request's settings (names as the fields; None keeps the default).

        Raises InvalidParams naming the field for a value out of range, TypeError for a name
        that is not an overridable field (`OVERRIDABLE`; the canvas is the checkpoint's).
        """
        unknown = sorted(set(fields) - set(OVERRIDABLE))
        if unknown:
            raise TypeError(f"not a per-request DiffusionGemma setting: {', '.join(unknown)}")
        given = {k: v for k, v in fields.items() if v is not None}
        if "eos_token_ids" in given and isinstance(given["eos_token_ids"], int):
            given["eos_token_ids"] = [given["eos_token_ids"]]
        values = {**dataclasses.asdict(self), **given}
        problem = _first_problem(values, blame_t_min="t_min" in given and "t_max" not in given)
        if problem is not None:
            raise InvalidParams(*problem)
        return dataclasses.replace(self, **_normalised(given))


def _is_int(value: object) -> bool:
    # bool is an int subclass; `true` in a JSON file is not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _first_problem(
    values: Mapping[str, Any], *, blame_t_min: bool = False
) -> tuple[str, str] | None:
    """(field, message) of the first value out of its range, else None."""
    for field, (kind, low, inclusive) in _RANGES.items():
        v = values[field]
        ok_type = _is_int(v) if kind == "int" else _is_number(v)
        bound = f">= {low:g}" if inclusive else f"> {low:g}"
        noun = "an integer" if kind == "int" else "a number"
        if not ok_type or (v < low if inclusive else v <= low):
            return field, f"must be {noun} {bound}, got {v!r}"
    if values["t_max"] <= values["t_min"]:
        field = "t_min" if blame_t_min else "t_max"
        return field, (
            f"t_max ({values['t_max']}) must exceed t_min ({values['t_min']}): the schedule "
            "cools from t_max at the first step towards t_min"
        )
    eos = values["eos_token_ids"]
    if not isinstance(eos, list | tuple) or not all(_is_int(t) and t >= 0 for t in eos):
        return "eos_token_ids", f"must be token ids (integers >= 0), got {eos!r}"
    pad = values["pad_token_id"]
    if pad is not None and not (_is_int(pad) and pad >= 0):
        return "pad_token_id", f"must be a token id (an integer >= 0) or null, got {pad!r}"
    return None


def _normalised(values: Mapping[str, Any]) -> dict[str, Any]:
    """Checked VALUES in the dataclass's types: floats for numbers, a tuple of EOS ids."""
    out = dict(values)
    for field in ("entropy_bound", "t_min", "t_max", "confidence_threshold"):
        if field in out:
            out[field] = float(out[field])
    if "eos_token_ids" in out:
        out["eos_token_ids"] = tuple(out["eos_token_ids"])
    return out


def _file_name(field: str) -> str:
    """FIELD as `generation_config.json` spells it."""
    return {
        "entropy_bound": "sampler_config.entropy_bound",
        "eos_token_ids": "eos_token_id",
        "canvas_length": "canvas_length (config.json)",
    }.get(field, field)
