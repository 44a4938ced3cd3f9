"""A static-shape KV cache "slab" with one row (slot) per running sequence.

Layout per layer: ``[max_slots, kv_heads, capacity, head_dim]``. Running sequences
occupy slots ``0..N-1`` (kept contiguous: a finished sequence's hole is filled by
moving the last row in), so the batched decode attends over a *view*
``slab[:N, :, :T]`` with no copy, each row at its own position under a mask. There is
no padding between a sequence's tokens: row ``r`` holds positions ``0..len_r-1``
exactly; the masked tail beyond ``len_r`` is zeros or stale values and never read.

The capacity (time axis) grows by doubling, up to the model's context, as the longest
sequence grows, so memory follows use.

The cache is handed to a Hugging Face decoder as its ``cache``; each attention layer
calls ``update(key, value, layer_idx, ...)`` which writes the new keys/values at the
planned positions and returns what that layer must attend over.
"""

from __future__ import annotations

from typing import Any

import torch


class SlabKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        max_slots: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        initial_capacity: int = 256,
    ) -> None:
        self.num_layers = num_layers
        self.max_slots = max_slots
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = device
        self.capacity = min(max_len, initial_capacity)
        self.k = [self._alloc(self.capacity) for _ in range(num_layers)]
        self.v = [self._alloc(self.capacity) for _ in range(num_layers)]
        # the plan of the forward about to run (set by plan_decode / plan_prefill)
        self._mode = "none"
        self._rows = 0
        self._slots: torch.Tensor | None = None
        self._row_index: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._att_len = 0

    def _alloc(self, capacity: int) -> torch.Tensor:
        # zeros, not empty: masked positions must hold finite numbers (0 * NaN is NaN)
        return torch.zeros(
            self.max_slots, self.kv_heads, capacity, self.head_dim, dtype=self.dtype, device=self.device
        )

    def nbytes(self) -> int:
        return 2 * self.num_layers * self.k[0].numel() * self.k[0].element_size()

    @torch.inference_mode()
    def ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if needed > self.max_len:
            raise ValueError(f"KV cache needs {needed} positions but the context is {self.max_len}")
        new = self.capacity
        while new < needed:
            new *= 2
        new = min(new, self.max_len)
        for layer in range(self.num_layers):
            for store in (self.k, self.v):
                grown = self._alloc(new)
                grown[:, :, : self.capacity].copy_(store[layer])
                store[layer] = grown
        self.capacity = new

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst`` (hole filling)."""
        if src == dst or length <= 0:
            return
        for layer in range(self.num_layers):
            self.k[layer][dst, :, :length].copy_(self.k[layer][src, :, :length])
            self.v[layer][dst, :, :length].copy_(self.v[layer][src, :, :length])

    def plan_decode(self, rows: int, positions: torch.Tensor, att_len: int) -> None:
        """Next forward: one token for each of slots ``0..rows-1`` at ``positions[r]``."""
        self._mode = "decode"
        self._rows = rows
        self._positions = positions
        self._row_index = torch.arange(rows, device=self.device)
        self._att_len = att_len

    def plan_prefill(self, slots: torch.Tensor, positions: torch.Tensor, att_len: int, fresh: bool) -> None:
        """Next forward: ``[P, S]`` tokens for ``slots`` at ``positions[p, s]``.

        ``fresh`` (every row starts at position 0) lets attention use the new keys as
        they are instead of gathering the rows back out of the slab.
        """
        self._mode = "prefill_fresh" if fresh else "prefill"
        self._slots = slots
        self._positions = positions
        self._att_len = att_len

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_store, v_store = self.k[layer_idx], self.v[layer_idx]
        if self._mode == "decode":
            # key: [R, H, 1, D] -> written at (r, :, pos_r, :)
            k_store[self._row_index, :, self._positions] = key[:, :, 0]
            v_store[self._row_index, :, self._positions] = value[:, :, 0]
            return k_store[: self._rows, :, : self._att_len], v_store[: self._rows, :, : self._att_len]
        assert self._slots is not None and self._positions is not None
        slots = self._slots.unsqueeze(1)
        # key: [P, H, S, D] -> indexed as [P, S, H, D]
        k_store[slots, :, self._positions] = key.transpose(1, 2)
        v_store[slots, :, self._positions] = value.transpose(1, 2)
        if self._mode == "prefill_fresh":
            return key, value
        k = k_store.index_select(0, self._slots)[:, :, : self._att_len]
        v = v_store.index_select(0, self._slots)[:, :, : self._att_len]
        return k, v

    # Hugging Face models may ask these of a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.num_layers
