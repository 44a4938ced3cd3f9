"""LoRA deltas by row: each token of a forward through its own adapter (PEFT's mixed batch).

PEFT's ``lora.Linear`` takes per-row ``adapter_names`` and, in every layer, scans that list in
Python for each adapter's rows (``_mixed_batch_forward``): for a prompt forward of a few hundred
tokens through 120 LoRA layers that scan cost more than the deltas (SmolLM2, 16 prompts of 23
tokens, half through a rank-8 q/k/v/o adapter: +35 ms on a 230 ms forward). ``LoraRows`` finds
the rows once a forward; ``routed_forward`` is the mixed batch's arithmetic on them, the same
operations on the same values (bit for bit: ``test_fused_decode.py`` compares the lean forward,
which adds its deltas this way, against PEFT's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class LoraRows:
    """The rows of one forward by adapter (the base model's rows left out); ``None`` where an
    adapter has every row of the forward (nothing to gather or scatter)."""

    rows: dict[str, torch.Tensor | None]

    @classmethod
    def of(cls, adapters: list[str], base: str, device: torch.device, *, whole: bool) -> LoraRows | None:
        """The rows of each adapter in ``adapters`` (one name per row; ``base``: no adapter), or
        None when no row has one. ``whole``: ``None`` for an adapter that has every row."""
        by_adapter: dict[str, list[int]] = {}
        for row, name in enumerate(adapters):
            if name != base:
                by_adapter.setdefault(name, []).append(row)
        if not by_adapter:
            return None
        return cls(
            {
                name: None if whole and len(rows) == len(adapters) else torch.tensor(rows, device=device)
                for name, rows in by_adapter.items()
            }
        )

    def add(self, layer: Any, x: torch.Tensor, result: torch.Tensor) -> None:
        """Add ``layer``'s deltas of ``x`` to ``result`` (its base product, or a slice of a product
        of several layers side by side)."""
        # PEFT's mixed batch (lora.Linear._mixed_batch_forward), its modules' own operations called
        # directly: nn.Linear is F.linear, and the dropout of a model in eval mode returns its input
        for name, rows in self.rows.items():
            if name not in layer.lora_A:
                continue
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            sub = (x if rows is None else x[rows]).to(lora_a.weight.dtype)
            if layer.training:
                sub = layer.lora_dropout[name](sub)
            delta = F.linear(F.linear(sub, lora_a.weight, lora_a.bias), lora_b.weight, lora_b.bias)
            delta = (delta * layer.scaling[name]).to(result.dtype)
            if rows is None:
                result += delta
            else:
                result[rows] += delta


def routable(module: Any) -> bool:
    """A plain PEFT LoRA linear layer (DoRA and PEFT's other variants keep PEFT's forward)."""
    try:
        from peft.tuners.lora import Linear
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, Linear) and not getattr(module, "lora_variant", None)


def routed_forward(layer: Any, rows: LoraRows, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``layer``'s forward for a forward whose rows are routed by ``rows`` (``adapter_names``,
    which PEFT's forward would scan, is not needed)."""
    kwargs.pop("adapter_names", None)
    result = layer.base_layer(x, *args, **kwargs)
    rows.add(layer, x, result)
    return result
