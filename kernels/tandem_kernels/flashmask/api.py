"""``flashmask_attention``: one entry point, the implementation picked by argument or platform."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem_kernels.flashmask.bounds import normalize_bounds
from tandem_kernels.flashmask.reference import reference_attention
from tandem_kernels.flashmask.torch_impl import torch_flashmask_attention

IMPLS = ("auto", "torch", "triton", "reference")


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: a cuda/xpu device with Triton installed.

    Kernels are the bottom layer and know nothing of the services' platform settings: a caller
    that knows more (a forced device, a platform without Triton) passes its own ``triton_ok``.
    """
    if device.type not in ("cuda", "xpu"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_impl(
    q: torch.Tensor, impl: str = "auto", *, triton_ok: Callable[[torch.device], bool] = triton_usable
) -> str:
    """The implementation ``flashmask_attention`` would run for ``q`` (``auto`` resolved)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {', '.join(IMPLS)}")
    if impl != "auto":
        return impl
    return "triton" if triton_ok(q.device) else "torch"


def flashmask_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    startend_row_indices: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    impl: str = "auto",
    deterministic: bool = False,
    triton_ok: Callable[[torch.device], bool] = triton_usable,
) -> torch.Tensor:
    """Attention with a FlashMask column-wise mask; see :mod:`tandem_kernels.flashmask.masks` for the format.

    ``q [B, Sq, Hq, D]``, ``k``/``v`` ``[B, Sk, Hk, D]`` with ``Hq % Hk == 0``;
    ``startend_row_indices`` int32 ``[B or 1, Hm, Sk, C]`` with ``Hm`` 1 or ``Hq``, or None
    for plain causal (``causal=True``) or full attention. Returns ``q``'s shape and dtype.
    Query rows that see no key get zeros. ``impl``: ``auto`` (Triton on cuda/xpu, torch
    elsewhere), ``torch``, ``triton`` (head dims other than 64/128 fall back to torch),
    ``reference`` (dense mask + SDPA, for tests). ``deterministic`` makes the Triton
    backward accumulate without atomics (the torch path always is). ``triton_ok(device)``
    decides whether ``auto`` may take Triton (default: :func:`triton_usable`).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, S, H, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, sq, hq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[:3] != v.shape[:3] or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    hk = k.shape[2]
    if hq % hk:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {hk}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if startend_row_indices is not None and startend_row_indices.dim() == 4:
        hm = startend_row_indices.shape[1]
        if hm not in (1, hq):
            raise ValueError(f"startend_row_indices has {hm} heads; it must have 1 or {hq} (the query heads)")
    scale = float(softmax_scale) if softmax_scale is not None else d**-0.5
    chosen = choose_impl(q, impl, triton_ok=triton_ok)
    if chosen == "reference":
        return reference_attention(q, k, v, startend_row_indices, causal=causal, softmax_scale=scale)
    bounds = normalize_bounds(
        startend_row_indices, causal=causal, batch=b, sq=sq, sk=k.shape[1], device=q.device
    )
    if chosen == "triton":
        from tandem_kernels.flashmask.triton_impl import supports, triton_flashmask_attention

        if supports(q, v):
            return triton_flashmask_attention(
                q, k, v, bounds, scale, causal_hint=causal, deterministic=deterministic
            )
    return torch_flashmask_attention(q, k, v, bounds, scale, causal=causal)
