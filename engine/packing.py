"""Prepacked CPU weights: projection matrices kept in oneDNN's blocked layout.

On a CPU, `F.linear` hands every bf16 matmul to oneDNN, which first reorders the weight into
its blocked (AMX / AVX-512 tile) layout, on every call. For the small matmuls of a denoising
step (a 32-token block, a few tokens per expert) that reorder costs as much as the product:
measured on a 2-core Xeon with AMX, a 4x512 @ 512x512 bf16 product takes ~40 us through
`F.linear` and ~27 us prepacked, the 18-row LM head of a 32k vocabulary 1.5 ms vs 0.9 ms.
Packing once at load removes the reorder. For the few-row products of a denoising step the
kernel that runs is the one `F.linear` picks, so bf16 / fp16 results are bit-identical (tested);
for products of a few hundred rows (prefill) `F.linear` switches to another blocking and the two
agree to rounding. fp32 is different: `F.linear` runs MKL's sgemm, whose few-row products
(the experts' 2-8 tokens, the router) beat oneDNN's fixed ~25 us per call on that Intel Xeon,
while oneDNN is 1.2-2x faster on the LM head and on the attention projections of a block
(measured on the same machine, 1 and 2 threads): there "auto" packs those for fp32 and leaves
the MoE to MKL. On other vendors' CPUs MKL's sgemm takes a generic path and packed oneDNN wins at
every size (`sgemm_leads_few_rows`), so "auto" packs the experts too. Packed fp32 products agree
with MKL's to rounding.

A packed weight is an opaque `torch._mkldnn` tensor of the same size: it replaces the plain
one (no second copy), cannot be sliced or trained, and only `linear` below multiplies by it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

PackPolicy = Literal["auto", "on", "off"]
# What gets packed: nothing; every projection except the MoE router and experts; everything.
PackScope = Literal["none", "dense", "all"]

# oneDNN computes these for F.linear too: packing all of them pays.
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch can prepack DTYPE weights for DEVICE (oneDNN on a CPU)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    try:
        linear(torch.zeros(1, 8, dtype=dtype), pack(torch.zeros(8, 8, dtype=dtype)))
    except (RuntimeError, AttributeError):
        return False
    return True


def scope(
    policy: PackPolicy, device: torch.device, weights: torch.dtype, compute: torch.dtype
) -> PackScope:
    """What to pack: nothing when the weights are widened per matmul (stored narrower than the
    compute dtype: a packed copy would be in the wrong dtype) or oneDNN cannot; "on": every
    projection; "auto": every one in half precision, and in fp32 all but the MoE's few-row ones
    where MKL's sgemm is the faster on those (`sgemm_leads_few_rows`), every one elsewhere."""
    if policy == "off" or weights != compute or not supported(device, compute):
        return "none"
    if policy == "on" or compute in _HALF_DTYPES or not sgemm_leads_few_rows():
        return "all"
    return "dense"


@functools.cache
def sgemm_leads_few_rows() -> bool:
    """Whether MKL's fp32 sgemm beats a packed oneDNN product on the few rows of a step's MoE
    experts: on Intel CPUs (see the module's note). Elsewhere MKL runs a generic code path;
    measured on 2-core AMD EPYC VMs (Zen 3, AVX2; Zen 4, AVX-512), us per 512x256 product over 32
    distinct matrices, MKL vs packed oneDNN: 1 row 82 vs 64, 4 rows 137 vs 58, 16 rows 130 vs
    83, 64 rows 311 vs 190 (Zen 4); and on the demo model, threshold 0.9 at batch 1, fp32 149 ->
    177 tokens/s with the experts packed. A CPU whose vendor cannot be read keeps the Intel
    rule."""
    return cpu_vendor() in ("GenuineIntel", None)


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's vendor as Linux reports it ("GenuineIntel", "AuthenticAMD"), or None where
    CPUINFO is unreadable or names none (ARM lists an implementer code instead)."""
    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


def pack(weight: Tensor) -> Tensor:
    """WEIGHT (out, in) in oneDNN's blocked layout. (oneDNN also takes a hint of the rows per
    call; none is given: one layout serves the few-row steps and the prefill alike.)"""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def is_packed(weight: Tensor) -> bool:
    """Whether WEIGHT is a packed (opaque oneDNN) tensor."""
    return weight.is_mkldnn


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias for a packed weight (x of any leading shape)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
