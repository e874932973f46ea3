"""Preallocated key/value cache: one slot per running sequence, one tensor pair per layer.

The cache only stores tensors. Which slot belongs to which request, and how many of its positions
are committed, is the scheduler's business (it passes `slots` and `cache_lens` to the forward).
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


class KVCache:
    """Keys and values of shape (num_slots, num_kv_heads, max_seq_len, head_dim) per layer."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        max_seq_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(
                f"KVCache needs num_slots >= 1 and max_seq_len >= 1, got {num_slots}, {max_seq_len}"
            )
        self.config = config
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, config.num_kv_heads, max_seq_len, config.head_dim)
        # Zero-filled so a stray read of an uncommitted position is finite, never NaN garbage.
        self.keys = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]
        self.values = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of one slot takes over all layers (keys and values)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return (
            2 * self.config.num_layers * self.config.num_kv_heads * self.config.head_dim * element
        )

    @property
    def bytes_total(self) -> int:
        """Bytes the whole cache holds."""
        return self.bytes_per_token * self.num_slots * self.max_seq_len

    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Stores k/v of shape (N, kv_heads, T, head_dim) at `positions` (N, T) of `slots` (N,)."""
        n, _, t, _ = k.shape
        rows = slots.view(n, 1).expand(n, t)
        # Advanced indexing on dims 0 and 2 puts the (N, T) index dims first: (N, T, kv_heads, D).
        self.keys[layer][rows, :, positions] = k.transpose(1, 2).to(self.dtype)
        self.values[layer][rows, :, positions] = v.transpose(1, 2).to(self.dtype)

    def read(
        self, layer: int, slots: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `slots` for positions [0, length): (N, kv_heads, length, head_dim)."""
        keys, values = self.keys[layer], self.values[layer]
        if slots.numel() == 1:
            # One row: a view, no gather (the common batch-1 case).
            s = int(slots[0])
            return keys[s : s + 1, :, :length], values[s : s + 1, :, :length]
        return keys[slots, :, :length], values[slots, :, :length]

    def check_call(
        self,
        n: int,
        positions: torch.Tensor,
        block: torch.Tensor,
        slots: torch.Tensor | None,
        cache_lens: torch.Tensor | None,
        write_cache: bool,
    ) -> int:
        """Validates a forward's cache arguments (one host sync for all bounds).

        Returns the longest cache_len of the call's rows.
        """
        if slots is None or cache_lens is None or slots.shape != (n,) or cache_lens.shape != (n,):
            raise ValueError(
                f"a cached call needs slots and cache_lens of shape ({n},), one per row"
            )
        if n == 0:
            return 0
        top_pos, top_slot, low_slot, top_len, low_len, low_block = torch.stack(
            (
                positions.max() if positions.numel() else positions.new_tensor(-1),
                slots.max(),
                slots.min(),
                cache_lens.max(),
                cache_lens.min(),
                block.min(),
            )
        ).tolist()
        if low_slot < 0 or top_slot >= self.num_slots:
            raise ValueError(f"slots must be in [0, {self.num_slots}), got {low_slot}..{top_slot}")
        reach = max(top_len, top_pos + 1) if write_cache else top_len
        if low_len < 0 or reach > self.max_seq_len:
            raise ValueError(
                f"positions/cache_lens reach {reach} but the cache holds "
                f"{self.max_seq_len} positions per slot"
            )
        if low_block < 1:
            raise ValueError(f"block_size must be at least 1, got {low_block}")
        return int(top_len)
