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

Whole prompts are stored (a conversation's next turn extends its last prompt), and so is the
prefix where a stored prompt branches off another one (the chat template's system prompt,
an agent's instructions): a *shared* entry. Every lookup refreshes the entries its prompt
contains whole, and eviction takes whole prompts before shared prefixes (while those hold at
most half the bytes), so a prefix many requests share stays while the unique prompts stored
after it go (without this, 16 streams of unique questions evicted one adapter's system prompt
within two bursts of another's, and that adapter's next burst computed it again first).
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
    # where stored prompts branch off each other: kept when a longer prompt covers it
    shared: bool = False


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
        self.query_tokens = 0  # prompt tokens looked up (the scheduler counts each prompt once)
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
        contained = []
        for entry in self.entries.values():
            if entry.adapter != adapter:
                continue
            n = common_prefix_len(entry.tokens, prompt)
            if n == len(entry.tokens):
                contained.append(entry)
            n = min(n, cap)
            if n > best_len:
                best, best_len = entry, n
        if best is None or best_len < self.min_tokens:
            return None, 0
        # the prefixes this prompt shares whole stay (see the module doc), the match most of all
        for entry in [*contained, best]:
            self.entries.move_to_end((entry.adapter, entry.tokens))
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
        branch = 0  # the longest prefix this prompt shares with another stored one, but neither whole
        for (a, t), entry in self.entries.items():
            if a != adapter:
                continue
            n = common_prefix_len(t, key)
            if n == length:
                return  # already covered by a longer (or equal) entry
            if n < len(t) or entry.shared:
                branch = max(branch, n)
        # entries that are strict prefixes of this one are now redundant (not the shared ones)
        for k in [k for k, e in self.entries.items() if k[0] == adapter and key[: len(k[1])] == k[1]]:
            if not self.entries[k].shared:
                self.nbytes -= self.entries.pop(k).nbytes
        if branch >= self.min_tokens and (adapter, key[:branch]) not in self.entries:
            self._add(adapter, key[:branch], cache, slot, shared=True)
        self._add(adapter, key, cache, slot, shared=False)

    def _add(
        self, adapter: str, key: tuple[int, ...], cache: SlabKVCache, slot: int, *, shared: bool
    ) -> None:
        length = len(key)
        ks = [cache.k[layer][slot, :, :length].clone() for layer in range(cache.num_layers)]
        vs = [cache.v[layer][slot, :, :length].clone() for layer in range(cache.num_layers)]
        nbytes = 2 * sum(t.numel() * t.element_size() for t in ks)
        if nbytes > self.max_bytes:
            return
        self.entries[(adapter, key)] = PrefixEntry(adapter, key, ks, vs, nbytes, shared)
        self.nbytes += nbytes
        self._evict()

    def _evict(self) -> None:
        """Least recently used first, whole prompts before shared prefixes while the shared ones
        hold at most half the bytes: a burst of unique prompts must not push out the prefix
        every one of them starts with."""
        shared = sum(e.nbytes for e in self.entries.values() if e.shared)
        while self.nbytes > self.max_bytes:
            victim = None
            if shared <= self.max_bytes // 2:
                victim = next((k for k, e in self.entries.items() if not e.shared), None)
            if victim is None:
                victim = next(iter(self.entries))
            old = self.entries.pop(victim)
            self.nbytes -= old.nbytes
            if old.shared:
                shared -= old.nbytes
