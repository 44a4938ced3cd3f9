"""LoRA deltas by row: each token of a forward through its own adapter (PEFT's mixed batch).

PEFT's ``lora.Linear`` takes per-row ``adapter_names`` and, in every layer, scans that list in
Python for each adapter's rows (``_mixed_batch_forward``): for a prompt forward of a few hundred
tokens through 120 LoRA layers that scan cost more than the deltas (SmolLM2, 16 prompts of 23
tokens, half through a rank-8 q/k/v/o adapter: +35 ms on a 230 ms forward). ``LoraRows`` finds
the rows once a forward; ``routed_forward`` is the mixed batch's arithmetic on them, with A and B
multiplied in fixed blocks of rows so that a row's delta does not depend on how many rows its
adapter has in the forward (PEFT's ``F.linear`` does: greedy output of an adapter's request would then move
with what shares its batch). Within rounding of PEFT's (``test_lora_rows.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# A and B multiply in blocks of exactly this many rows (zero rows fill the last): MKL's product
# (F.linear) computes a row differently by how many rows it multiplies at once (every LoRA shape
# of SmolLM2, measured: 1 row, 2-3 rows and 4+ rows give three different last bits), but at a
# fixed row count a row's result depends on that row alone, wherever it sits in the block. So an
# adapter's request gets the same numbers alone as beside other requests of that adapter.
BLOCK = 64


def padded(x: torch.Tensor) -> torch.Tensor:
    """``x``'s rows as ``[n, in]``, zero rows added up to a multiple of ``BLOCK`` (on a CPU)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if x.device.type != "cpu" or rows % BLOCK == 0:
        return flat
    return torch.cat([flat, flat.new_zeros(BLOCK - rows % BLOCK, flat.shape[1])])


def product(linear: torch.nn.Linear, flat: torch.Tensor) -> torch.Tensor:
    """``linear`` of ``padded`` rows, block by block: each row's result independent of the
    other rows (on a CPU)."""
    return blocked(flat, linear.weight, linear.bias)


def blocked(flat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of ``padded`` rows, block by block (see ``product``)."""
    if flat.device.type != "cpu" or flat.shape[0] == BLOCK:
        return F.linear(flat, weight, bias)
    return torch.cat([F.linear(flat[i : i + BLOCK], weight, bias) for i in range(0, flat.shape[0], BLOCK)])


@dataclass
class Stacked:
    """One adapter's LoRA modules on projections multiplied side by side (``fused_decode``'s
    q/k/v, gate/up) as two products for all of them: their A matrices stacked by rows, and their
    B matrices times the scaling placed block-diagonally over the product's columns (zeros where
    a projection has no module of the adapter). Each row's delta is the modules' deltas within
    rounding (the scaling multiplies B, not the delta, and a stacked product sums over zeros
    too), in two products and one gather and scatter instead of that many per module."""

    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [the product's out, sum of ranks]

    @classmethod
    def of(cls, layers: list[Any | None], sizes: list[int], name: str) -> Stacked | None:
        """The stack of adapter ``name`` over the projections' LoRA layers (None where a
        projection has none) of ``sizes`` output columns each; None when no projection has
        the adapter, or a module of it has biases (not stacked)."""
        found = [(i, layer) for i, layer in enumerate(layers) if layer is not None and name in layer.lora_A]
        if not found or any(
            layer.lora_A[name].bias is not None or layer.lora_B[name].bias is not None for _, layer in found
        ):
            return None
        a = torch.cat([layer.lora_A[name].weight.detach().float() for _, layer in found])
        b = a.new_zeros(sum(sizes), a.shape[0])
        rank = 0
        for i, layer in found:
            weight = layer.lora_B[name].weight.detach().float()
            start = sum(sizes[:i])
            b[start : start + weight.shape[0], rank : rank + weight.shape[1]] = weight * layer.scaling[name]
            rank += weight.shape[1]
        return cls(a.contiguous(), b)


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
        # PEFT's mixed batch (lora.Linear._mixed_batch_forward) with A and B as row-invariant
        # products (``product``); the dropout of a model in eval mode returns its input
        for name, rows in self.rows.items():
            if name not in layer.lora_A:
                continue
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            sub = (x if rows is None else x[rows]).to(lora_a.weight.dtype)
            if layer.training:
                sub = layer.lora_dropout[name](sub)
            # A then B on the padded rows (B's input is padded already), the padding dropped after
            delta = product(lora_b, product(lora_a, padded(sub)))[: sub.numel() // sub.shape[-1]]
            delta = (delta.view(*sub.shape[:-1], -1) * layer.scaling[name]).to(result.dtype)
            if rows is None:
                result += delta
            else:
                result[rows] += delta

    def add_stacked(self, name: str, stacked: Stacked, x: torch.Tensor, result: torch.Tensor) -> None:
        """Add adapter ``name``'s deltas of ``x`` ``[n, in]`` through ``stacked`` (its modules on a
        side-by-side product) to ``result`` ``[n, out]``, for its rows."""
        rows = self.rows[name]
        sub = (x if rows is None else x.index_select(0, rows)).to(stacked.a.dtype)
        count = sub.shape[0]
        delta = blocked(blocked(padded(sub), stacked.a), stacked.b)[:count].to(result.dtype)
        if rows is None:
            result += delta
        else:
            result.index_add_(0, rows, delta)


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
