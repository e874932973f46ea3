"""The encoder's keys and values: one slot per running sequence, preallocated.

Layers differ in shape (sliding and full-attention layers have their own head size and K/V
heads) and in how much they keep: a full-attention layer keeps every position below
`max_seq_len`; a sliding layer keeps only the last `config.sliding_context` positions, in a
ring (position p at index p % capacity), since nothing ever looks further back. So one slot
costs a fixed part (the rings) plus `bytes_per_token` for each position of `max_seq_len`.

The store only holds tensors. Which slot is whose and how many positions each has encoded is
the caller's (it passes `slots` and `cache_lens`); commits only append.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.families.diffusion_gemma.config import DiffusionGemmaConfig


def cached_positions(cache_lens: Tensor, capacity: int, length: int) -> Tensor:
    """Positions (N, length) held at the first LENGTH indices of a layer of CAPACITY for rows that
    have encoded CACHE_LENS (N,) tokens; negative where an index holds nothing yet.

    Index j holds the latest position p < cache_len with p % capacity == j."""
    last = cache_lens.view(-1, 1) - 1
    j = torch.arange(length, device=cache_lens.device).view(1, -1)
    return last - torch.remainder(last - j, capacity)


class EncoderKV:
    """Keys and values per layer, each (num_slots, kv_heads, capacity, head_dim)."""

    def __init__(
        self,
        config: DiffusionGemmaConfig,
        num_slots: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(
                f"EncoderKV needs num_slots >= 1 and max_seq_len >= 1, got {num_slots}, "
                f"{max_seq_len}"
            )
        self.config = config
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacities = config.kv_capacities(max_seq_len)
        shapes = [
            (num_slots, kv, cap, d)
            for kv, d, cap in zip(
                config.num_kv_heads, config.head_dims, self.capacities, strict=True
            )
        ]
        # Zero-filled so a masked read of a never-written index is finite, never NaN garbage.
        self.keys = [torch.zeros(s, dtype=dtype, device=self.device) for s in shapes]
        self.values = [torch.zeros(s, dtype=dtype, device=self.device) for s in shapes]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one more position of `max_seq_len` costs a slot (its full-attention layers)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        grown = self.config.kv_bytes_per_sequence(self.max_seq_len + 1, element)
        return grown - self.bytes_per_slot

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot takes: the sliding rings plus `bytes_per_token * max_seq_len`."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.config.kv_bytes_per_sequence(self.max_seq_len, element)

    @property
    def bytes_total(self) -> int:
        """Bytes the whole store holds."""
        return self.bytes_per_slot * self.num_slots

    def read(self, layer: int, slots: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """Keys and values at the first LENGTH indices of SLOTS: (N, kv_heads, length, d) each;
        `cached_positions` says which position each index holds."""
        keys, values = self.keys[layer], self.values[layer]
        if slots.numel() == 1:
            # One row: a view, no gather (the common batch-1 case).
            s = int(slots[0])
            return keys[s : s + 1, :, :length], values[s : s + 1, :, :length]
        return keys[slots, :, :length], values[slots, :, :length]

    def write(
        self,
        layer: int,
        slots: Tensor,
        positions: Tensor,
        k: Tensor,
        v: Tensor,
        keep: Tensor | None,
    ) -> None:
        """Stores k/v (N, kv_heads, T, d) of POSITIONS (N, T) in SLOTS (N,); with KEEP (N, T)
        bool, only where it is True (the caller keeps at most one position per ring index)."""
        n, _, t, _ = k.shape
        rows = slots.view(n, 1).expand(n, t)
        index = torch.remainder(positions, self.capacities[layer])
        new_k, new_v = k.transpose(1, 2).to(self.dtype), v.transpose(1, 2).to(self.dtype)
        if keep is not None:
            rows, index, new_k, new_v = rows[keep], index[keep], new_k[keep], new_v[keep]
        # Advanced indexing on dims 0 and 2 puts the index dims first: (..., kv_heads, d).
        self.keys[layer][rows, :, index] = new_k
        self.values[layer][rows, :, index] = new_v

    def resized(self, max_seq_len: int, length: int) -> EncoderKV:
        """A store of MAX_SEQ_LEN positions per slot holding this one's first LENGTH positions
        (the rings whole: their indices do not depend on max_seq_len)."""
        if length > min(max_seq_len, self.max_seq_len):
            raise ValueError(f"cannot keep {length} positions in a store of {max_seq_len}")
        other = EncoderKV(
            self.config, self.num_slots, max_seq_len, dtype=self.dtype, device=self.device
        )
        for i, cap in enumerate(self.capacities):
            kept = cap if self.config.is_sliding(i) else length
            other.keys[i][:, :, :kept] = self.keys[i][:, :, :kept]
            other.values[i][:, :, :kept] = self.values[i][:, :, :kept]
        return other
