"""Triton kernels (in progress): until they land every call falls back to the torch path."""

from __future__ import annotations

import torch


def supports(q: torch.Tensor, v: torch.Tensor) -> bool:
    return False


def triton_flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: torch.Tensor,
    scale: float,
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    raise NotImplementedError("the Triton kernels are not written yet")
