"""``Runner``: what the scheduler and the engines over it ask of a model runner.

Two runners implement it: ``runner.ModelRunner`` (a Hugging Face model over the slab KV cache)
and ``llamacpp_engine.LlamaCppRunner`` (a llama.cpp context). The scheduler sees slots and
logits only: a runner keeps the keys/values of the sequence in each slot, runs one forward for
a step's decode tokens and prompt chunks, and hears when a sequence moves to a lower slot or
ends. The prefix cache copies slab rows, so only a runner with a slab (``prefix_kv``) can have
one.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from services.inference.engine.kv_cache import SlabKVCache
from services.inference.engine.ragged import DecodeRow, PrefillRow


class Runner(Protocol):
    @property
    def max_len(self) -> int:
        """Tokens one sequence may hold, prompt and output together."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the logits are (sampling generators are made there)."""
        ...

    @property
    def prefix_kv(self) -> SlabKVCache | None:
        """The slab a prefix cache copies keys/values from and into; None: no prefix cache."""
        ...

    def prepare_weights(self) -> None:
        """Ready every weight the forwards use, at start-up rather than in a request."""
        ...

    def forward(self, decode: list[DecodeRow], prefill: list[PrefillRow]) -> torch.Tensor:
        """Logits ``[D + P, V]``: one row per decode token, then one at each chunk's last token."""
        ...

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """The sequence in slot ``src`` (its first ``length`` positions computed) goes on in the
        freed slot ``dst``: the scheduler keeps its running slots contiguous."""
        ...

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` ended: free what the runner holds for it."""
        ...

    def reset(self) -> None:
        """Every sequence ended at once (a failed step, shutdown)."""
        ...

    def weights_fingerprint(self) -> tuple[Any, ...]:
        """Changes whenever the weights do: the prefix cache then drops its entries."""
        ...
