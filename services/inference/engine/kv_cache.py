"""A static-shape KV cache "slab" with one row (slot) per running sequence.

Layout per layer: ``[max_slots, kv_heads, capacity, head_dim]``. Running sequences
occupy slots ``0..N-1`` (kept contiguous: a finished sequence's hole is filled by
moving the last row in), so the batched decode attends over a *view*
``slab[:N, :, :T]`` with no copy, each row at its own position under a mask. There is
no padding between a sequence's tokens: row ``r`` holds positions ``0..len_r-1``
exactly; the masked tail beyond ``len_r`` is zeros or stale values and never read.

On the CPU each slab spans the whole context from the start, in an anonymous memory map: the
kernel hands out zeroed pages as positions are first written, so memory follows the positions
each slot has used, and a long prompt never waits for the slab to grow (growing 16 slots of a
0.6B model's fp32 keys and values to 2,048 positions zeroed and copied 7.5 GB: 8 s on a VM). On
a GPU the capacity (time axis) grows by doubling, up to the model's context, as the longest
sequence grows.

The cache is handed to a Hugging Face decoder as its ``cache``; each attention layer
calls ``update(key, value, layer_idx, ...)``, which writes the new keys/values at the
planned (slot, position) of each token and returns the layer's slab, from which the
ragged attention (``ragged.py``) reads what each token attends.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import InitVar, dataclass
from typing import Any

import torch

# the capacity is a multiple of this many positions: the ragged attention reads keys in whole
# blocks of it (``ragged.KEY_BLOCK``)
CAPACITY_BLOCK = 64


def round_up(n: int, block: int = CAPACITY_BLOCK) -> int:
    """``n`` rounded up to a whole number of ``block``s."""
    return -(-n // block) * block


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory map of its own: the pages are the kernel's
    zero pages until written, so only what is written takes memory (the tensor keeps the map
    alive)."""
    count = math.prod(shape)
    size = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=dtype, count=count).view(shape)


# eq=False: a cache is one object (compared and hashed by identity), not a value
@dataclass(kw_only=True, eq=False)
class SlabKVCache:
    num_layers: int
    max_slots: int
    kv_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype
    device: torch.device
    # the whole context at once in zeroed pages handed out as written (mapped_zeros); None: on
    # the CPU, where such a map exists
    lazy: bool | None = None
    initial_capacity: InitVar[int] = 256

    def __post_init__(self, initial_capacity: int) -> None:
        if self.lazy is None:
            self.lazy = self.device.type == "cpu"
        if self.lazy and self.device.type != "cpu":
            raise ValueError(f"a lazily mapped KV cache lives in CPU memory, not on {self.device}")
        # the context rounded up to whole blocks (the positions past it are never written)
        self._max_capacity = round_up(self.max_len)
        if self.lazy:
            try:
                self._allocate(self._max_capacity)
            except OSError:  # an address space the system will not promise (strict overcommit)
                self.lazy = False
        if not self.lazy:
            self._allocate(min(self._max_capacity, round_up(initial_capacity)))
        # where the forward about to run writes its keys/values (set by plan_writes)
        self._slots: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.k = [self._alloc(capacity) for _ in range(self.num_layers)]
        self.v = [self._alloc(capacity) for _ in range(self.num_layers)]

    def _alloc(self, capacity: int) -> torch.Tensor:
        # zeros, not empty: masked positions must hold finite numbers (0 * NaN is NaN).
        # Normal tensors even when grown inside a forward (inference mode): every slab is then
        # the same kind of tensor, which a compiled decode step guards on (it would compile
        # again at the first growth), and code outside inference mode may still write to it.
        with torch.inference_mode(False):
            return self._zeros(capacity)

    def _zeros(self, capacity: int) -> torch.Tensor:
        shape = (self.max_slots, self.kv_heads, capacity, self.head_dim)
        if self.lazy:
            return mapped_zeros(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def nbytes(self) -> int:
        return 2 * self.num_layers * self.k[0].numel() * self.k[0].element_size()

    @torch.inference_mode()
    def ensure_capacity(self, needed: int) -> None:
        # the context first: the capacity is rounded up past it to whole blocks
        if needed > self.max_len:
            raise ValueError(f"KV cache needs {needed} positions but the context is {self.max_len}")
        if needed <= self.capacity:
            return
        new = self.capacity
        while new < needed:
            new *= 2
        new = min(new, self._max_capacity)
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

    def plan_writes(self, slots: torch.Tensor, positions: torch.Tensor) -> None:
        """Next forward: token ``t`` (batch row ``t``) goes to slab row ``slots[t]`` at ``positions[t]``."""
        self._slots = slots
        self._positions = positions

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_: Any, **__: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's keys/values (``[T, Hkv, 1, D]``); return the layer's whole slab
        (the ragged attention reads the rows and positions its plan names)."""
        assert self._slots is not None and self._positions is not None, "plan_writes first"
        k_store, v_store = self.k[layer_idx], self.v[layer_idx]
        # (a 16-bit cache of an fp32 model, plan.kv_dtype: the keys and values rounded as stored)
        k_store[self._slots, :, self._positions] = key[:, :, 0].to(k_store.dtype)
        v_store[self._slots, :, self._positions] = value[:, :, 0].to(v_store.dtype)
        return k_store, v_store

    # Hugging Face models may ask these of a cache object.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.num_layers
