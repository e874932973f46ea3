"""Which keys each query sees, as boolean masks (N, T, K + T) over a layer's K stored keys
followed by the call's own T keys (the windows themselves are stated in `config`).

A stored key counts while its index holds a position (`kv.cached_positions` >= 0); an own key
while it is not padding. On top of that the encoder is causal unless bidirectional, and its
sliding layers see keys within `window` positions; the decoder sees every counted key.
"""

from __future__ import annotations

import torch
from torch import Tensor


def counted_keys(held: Tensor, own: int, real: Tensor | None) -> Tensor:
    """(N, K + own) bool: stored keys holding a position (HELD (N, K) >= 0), then own keys that
    are not padding (REAL (N, own) bool, None: all real)."""
    own_keys = torch.ones(held.shape[0], own, dtype=torch.bool, device=held.device)
    if real is not None:
        own_keys = own_keys & real
    return torch.cat((held >= 0, own_keys), dim=1)


def encoder_visibility(
    positions: Tensor, held: Tensor, real: Tensor | None, *, causal: bool, window: int | None
) -> Tensor:
    """What encoder queries at POSITIONS (N, T) see of HELD (N, K) stored positions and of the
    call's own tokens: causal (key <= query) or not, within WINDOW positions (None: any)."""
    n, t = positions.shape
    allowed = counted_keys(held, t, real).unsqueeze(1).expand(n, t, -1)
    query = positions.unsqueeze(2)
    key = torch.cat((held, positions), dim=1).unsqueeze(1)
    if causal:
        allowed = allowed & (key <= query)
    if window is not None:
        allowed = allowed & ((query - key).abs() <= window)
    # Every token sees itself, so a padding row's softmax is never empty (NaN).
    own = torch.arange(t, device=positions.device).view(-1, 1) + held.shape[1]
    itself = own == torch.arange(held.shape[1] + t, device=positions.device)
    return allowed | itself.unsqueeze(0)


def decoder_visibility(held: Tensor, canvas: int) -> Tensor:
    """What each of CANVAS decoder queries sees: every stored key holding a position, and the
    whole canvas."""
    counted = counted_keys(held, canvas, None)
    return counted.unsqueeze(1).expand(-1, canvas, -1)


def additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The (N, 1, T, K) additive form SDPA takes: 0 where allowed, -inf elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
