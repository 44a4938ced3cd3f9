"""Prefix cache: keys/values of already-computed prompt prefixes, copied into new slots.

Chat templates put the same tokens at the start of every request (SmolLM2's injects a
~20-token default system prompt; GRPO rollouts send one prompt ``n`` times; multi-turn
conversations resend their history). The key/value of position ``i`` depends only on
tokens ``0..i`` (and the weights), so any common prefix of a stored prompt is valid for a
new prompt: on admission the scheduler copies the longest match into the sequence's slot
and prefills only the rest.

Entries are keyed by adapter (a LoRA adapter changes the keys/values) and the whole cache
is dropped when the weights change (the trainer updates them in place between rollouts:
``weights_fingerprint`` sums the parameters' version counters, which every in-place
update bumps). Memory is bounded (LRU by bytes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from services.inference.engine.kv_cache import SlabKVCache


@dataclass
class PrefixEntry:
    adapter: str
    tokens: tuple[int, ...]
    k: list[torch.Tensor]  # per layer [kv_heads, L, head_dim]
    v: list[torch.Tensor]
    nbytes: int


def common_prefix_len(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tensors_state(tensors: list[Any]) -> tuple[int, int]:
    """Changes whenever one of ``tensors`` is updated in place (versions only grow, so their sum
    moves) or replaced by another tensor (its pointer)."""
    return sum(t._version for t in tensors), sum(t.data_ptr() for t in tensors)


def weights_fingerprint(model: Any) -> tuple[Any, ...]:
    """Changes whenever a parameter is updated in place, replaced, added or removed."""
    params = list(model.parameters())
    active = getattr(model, "active_adapter", None)
    return (len(params), *tensors_state(params), str(active))


class PrefixCache:
    def __init__(self, max_bytes: int, *, min_tokens: int = 4, max_entry_tokens: int = 2048) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.max_entry_tokens = max_entry_tokens
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], PrefixEntry] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.hit_tokens = 0
        self._fingerprint: tuple[Any, ...] | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0

    def validate(self, fingerprint: tuple[Any, ...]) -> None:
        """Drop everything if the weights changed since the entries were computed."""
        if fingerprint != self._fingerprint:
            self.clear()
            self._fingerprint = fingerprint

    def longest(self, adapter: str, prompt: list[int]) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (leaving its last token to compute)."""
        best: PrefixEntry | None = None
        best_len = 0
        cap = len(prompt) - 1  # the last prompt token must run through the model for its logits
        for entry in self.entries.values():
            if entry.adapter != adapter:
                continue
            n = min(common_prefix_len(entry.tokens, prompt), cap)
            if n > best_len:
                best, best_len = entry, n
        if best is None or best_len < self.min_tokens:
            return None, 0
        self.entries.move_to_end((best.adapter, best.tokens))
        return best, best_len

    def load_into(self, entry: PrefixEntry, length: int, cache: SlabKVCache, slot: int) -> None:
        cache.ensure_capacity(length)
        for layer in range(cache.num_layers):
            cache.k[layer][slot, :, :length].copy_(entry.k[layer][:, :length])
            cache.v[layer][slot, :, :length].copy_(entry.v[layer][:, :length])
        self.hits += 1
        self.hit_tokens += length

    def store(self, adapter: str, tokens: list[int], cache: SlabKVCache, slot: int) -> None:
        """Keep slot ``slot``'s keys/values of ``tokens`` (positions ``0..len-1``, all computed)."""
        length = min(len(tokens), self.max_entry_tokens)
        if not self.enabled or length < self.min_tokens:
            return
        key = tuple(tokens[:length])
        for a, t in self.entries:
            if a == adapter and len(t) >= length and t[:length] == key:
                return  # already covered by a longer (or equal) entry
        # entries that are strict prefixes of this one are now redundant
        for k in [k for k in self.entries if k[0] == adapter and key[: len(k[1])] == k[1]]:
            self.nbytes -= self.entries.pop(k).nbytes
        ks = [cache.k[layer][slot, :, :length].clone() for layer in range(cache.num_layers)]
        vs = [cache.v[layer][slot, :, :length].clone() for layer in range(cache.num_layers)]
        nbytes = 2 * sum(t.numel() * t.element_size() for t in ks)
        if nbytes > self.max_bytes:
            return
        self.entries[(adapter, key)] = PrefixEntry(adapter, key, ks, vs, nbytes)
        self.nbytes += nbytes
        while self.nbytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
