"""Prepacked oneDNN weights for the CPU engine's linear layers.

``nn.Linear`` on a CPU calls MKL's sgemm, which re-packs the weight matrix on every call.
For the engine's shapes that is most of the cost: a decode step multiplies 1-16 rows by
every weight, and a 16-row product took as long as 32 single rows (measured on 2 Zen 4
cores, SmolLM2-135M's shapes: 30 MLP matrices of 1536 x 576 at 16 rows, 12.6 ms with
``F.linear``, 6.1 ms prepacked; the 49K-row output head at 16 rows, 19.2 vs 6.1 ms; a
251-token prefill's worth of rows, 97 vs 66 ms). oneDNN's prepacked layout is what
inductor's CPU freezing and Intel's extension use; the numbers stay fp32 (bf16 for bf16
models), only the summation order differs, as between any two GEMM kernels.

The model's own ``nn.Linear`` modules stay in place and are untouched outside the
engine's forwards (so PEFT's LoRA wrappers, the trainer, ``state_dict``, deep copies and
pickling see nothing different): ``PackedLinears.active()`` gives each large layer a
forward that uses the packed copy for the length of one forward and takes it away
after. A weight that changed since it was packed is packed again (the trainer updates
weights in place between rollouts, which moves the tensor's version counter). The packed
copies cost one more copy of the linear weights in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger("tandem.engine.packed_linear")

# LoRA's own A/B matrices and other small layers gain nothing from packing
MIN_PACKED_ELEMENTS = 1 << 16


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing exists for CPU fp32 and bf16 weights in this torch build."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(8, 8, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 8, dtype=dtype), packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as exc:  # a torch built without oneDNN
        log.info("oneDNN packed linear unavailable: %s", exc)
        return False
    return bool(torch.allclose(out.float(), torch.full((1, 8), 8.0)))


class _Packed:
    """One layer's packed weight and the weight state it was packed from."""

    def __init__(self, module: torch.nn.Linear, batch_hint: int) -> None:
        self.module = module
        self.batch_hint = batch_hint
        self.key: tuple[int, int] | None = None
        self.weight: torch.Tensor | None = None

    def current(self) -> torch.Tensor:
        w = self.module.weight
        key = (w.data_ptr(), w._version)
        if key != self.key or self.weight is None:
            with torch.no_grad():
                self.weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.batch_hint)
            self.key = key
        return self.weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's own signature
        module = self.module
        if torch.is_grad_enabled() or input.dtype != module.weight.dtype:
            return F.linear(input, module.weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(input, self.current(), module.bias, "none", [], "")


class PackedLinears:
    """Packed-weight forwards for a model's large ``nn.Linear`` layers (see the module doc)."""

    def __init__(self, model: Any, batch_hint: int = 16) -> None:
        self.batch_hint = batch_hint
        self.layers: list[_Packed] = []
        self.refresh(model)

    def refresh(self, model: Any) -> None:
        """Track the large plain ``nn.Linear`` layers ``model`` has now (after a LoRA adapter
        was loaded or unloaded), keeping the packed copies of those it had."""
        known = {id(p.module): p for p in self.layers}
        self.layers = [
            known.get(id(m)) or _Packed(m, self.batch_hint)
            for m in model.modules()
            if type(m) is torch.nn.Linear and m.weight.numel() >= MIN_PACKED_ELEMENTS
        ]

    def pack_all(self) -> None:
        """Pack every weight now (at start-up, so the first request does not pay for it)."""
        for packed in self.layers:
            packed.current()

    @contextmanager
    def active(self) -> Iterator[None]:
        """The tracked layers compute with their packed weights inside this block."""
        for packed in self.layers:
            packed.module.forward = packed.forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            for packed in self.layers:
                vars(packed.module).pop("forward", None)
