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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger("tandem.engine.packed_linear")


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


class LinearKernel(Protocol):
    """How a layer multiplies inside the engine's forwards: a weight prepared once (packed,
    quantised) and the product with it. ``prepare`` runs again when the weight changes."""

    def prepare(self, weight: torch.Tensor) -> Any: ...

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor: ...


class OneDNNPacked:
    """The weight in oneDNN's prepacked layout, same dtype (see the module doc)."""

    def __init__(self, batch_hint: int = 16) -> None:
        self.batch_hint = batch_hint

    def prepare(self, weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.batch_hint)
        return packed, _lone_row_differs(packed, weight.shape[1], weight.dtype)

    def apply(self, input: torch.Tensor, prepared: Any, bias: torch.Tensor | None) -> torch.Tensor:
        packed, as_pair = prepared
        if as_pair and input.numel() == input.shape[-1]:
            # a lone row, where oneDNN's own lone-row path gives other last bits than its path
            # for 2 or more rows: computed as the first of two, so its result does not depend
            # on what shares the batch
            pair = torch.cat([input.reshape(1, -1)] * 2)
            out = torch.ops.mkldnn._linear_pointwise(pair, packed, bias, "none", [], "")[:1]
            return out.view(*input.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")

    # the lean forwards' two steps (``RowKernel``): the input as is, the product without bias
    def rows(self, input: torch.Tensor) -> torch.Tensor:
        return input

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor:
        return self.apply(rows, prepared, None)


def _lone_row_differs(packed: torch.Tensor, in_features: int, dtype: torch.dtype) -> bool:
    """Whether oneDNN computes one row of this layer differently alone than among others.
    Measured: rows 2..64 always agree with each other; a lone row does too, except in some
    shapes (SmolLM2's 1536 -> 576 down projection in fp32, not in bf16), so each layer is
    probed once when its weight is prepared (different arithmetic matching bit for bit on
    random rows would be a coincidence). In bf16 the probe is weak: a product's fp32 sum is
    rounded to bf16, which hides most differences in its last bits (SmolLM2's down projection
    in bf16: 30 of 172,800 values differ alone vs among others, so 3 rows rarely show one);
    so a bf16 weight always pairs its lone rows, unprobed."""
    if dtype == torch.bfloat16:
        return True
    rows = torch.randn(3, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    alone = torch.ops.mkldnn._linear_pointwise(rows[:1], packed, None, "none", [], "")
    among = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")[:1]
    return not torch.equal(alone, among)


class RowKernel(LinearKernel, Protocol):
    """A kernel the lean forwards (``fused_decode.py``, ``fused_prompt.py``) multiply with in two
    steps, so that an input several products share is made ready once: ``rows`` is a ``[n, in]``
    input as the kernel takes it (cast, padded), ``product`` its product with a prepared weight,
    without bias, in the kernel's output dtype and with at least ``n`` rows (the first ``n`` are
    the input's)."""

    def rows(self, input: torch.Tensor) -> torch.Tensor: ...

    def product(self, rows: torch.Tensor, prepared: Any) -> torch.Tensor: ...


# picks the kernel of one layer (qualified name, module), or None to leave it plain
KernelChoice = Callable[[str, torch.nn.Linear], "LinearKernel | None"]


def packed_layers(batch_hint: int) -> KernelChoice:
    """oneDNN packing for every base layer, small ones too: small layers gain no speed, but MKL's
    product (``F.linear``) computes a row differently by the number of rows, and oneDNN's does
    not (see ``OneDNNPacked.apply``), so a token's numbers do not depend on what shares its batch.
    (LoRA's own A/B matrices are left out by ``PackedLinears.refresh``.)"""
    kernel = OneDNNPacked(batch_hint)
    return lambda _name, _module: kernel


class _Packed:
    """One layer's prepared weight and the weight state it was prepared from."""

    def __init__(self, module: torch.nn.Linear, kernel: LinearKernel) -> None:
        self.module = module
        self.kernel = kernel
        self.key: tuple[int, int] | None = None
        self.weight: Any = None

    def current(self) -> Any:
        w = self.module.weight
        key = (w.data_ptr(), w._version)
        if key != self.key or self.weight is None:
            with torch.no_grad():
                self.weight = self.kernel.prepare(w.detach())
            self.key = key
        return self.weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's own signature
        module = self.module
        if torch.is_grad_enabled() or input.dtype != module.weight.dtype:
            return F.linear(input, module.weight, module.bias)
        return self.kernel.apply(input, self.current(), module.bias)


class PackedLinears:
    """Prepared-weight forwards for a model's ``nn.Linear`` layers (see the module doc):
    oneDNN-packed by default, or whatever ``choose`` picks per layer (quantised kernels)."""

    def __init__(self, model: Any, batch_hint: int = 16, choose: KernelChoice | None = None) -> None:
        self.choose = choose or packed_layers(batch_hint)
        self.layers: list[_Packed] = []
        self.refresh(model)

    def refresh(self, model: Any) -> None:
        """Track the plain ``nn.Linear`` layers ``model`` has now (after a LoRA adapter was
        loaded or unloaded), keeping the prepared copies of those it had. PEFT's own LoRA
        matrices (``lora_A``/``lora_B``) stay plain: they are the adapter, not the base."""
        known = {id(p.module): p for p in self.layers}
        layers = []
        for name, module in model.named_modules():
            if type(module) is not torch.nn.Linear or ".lora_" in f".{name}":
                continue
            if id(module) in known:
                layers.append(known[id(module)])
            elif (kernel := self.choose(name, module)) is not None:
                layers.append(_Packed(module, kernel))
        self.layers = layers
        # the layers left once a skip set is taken out, by the set's identity (the lean forwards
        # pass the same sets every forward: filtered once each)
        self._filtered: dict[int, tuple[frozenset[int], list[_Packed]]] = {}

    def _without(self, skip: frozenset[int]) -> list[_Packed]:
        cached = self._filtered.get(id(skip))
        if cached is None or cached[0] is not skip:
            if len(self._filtered) >= 8:  # sets of an earlier adapter state
                self._filtered.clear()
            cached = self._filtered[id(skip)] = (skip, [p for p in self.layers if id(p.module) not in skip])
        return cached[1]

    def pack_all(
        self, no_decode_side: frozenset[int] = frozenset(), no_prompt_side: frozenset[int] = frozenset()
    ) -> None:
        """Prepare every weight now (at start-up, so the first request does not pay for it),
        but the decode side of the layers in ``no_decode_side`` and the prompt side of those in
        ``no_prompt_side`` (module ids: layers whose decode or prompt tokens a lean forward
        multiplies with copies of its own; made when first asked, if ever)."""
        for packed in self.layers:
            prepared = packed.current()
            for side, skip in (("decode_side", no_decode_side), ("prompt_side", no_prompt_side)):
                make = getattr(packed.kernel, side, None)
                if make is not None and id(packed.module) not in skip:
                    make(prepared)

    @contextmanager
    def active(self, skip: frozenset[int] = frozenset()) -> Iterator[None]:
        """The tracked layers (but those whose module id is in ``skip``) compute with their
        packed weights inside this block."""
        layers = self._without(skip) if skip else self.layers
        # straight into the instance dict: ``nn.Module.__setattr__`` checks parameters, buffers
        # and submodules first (~3.5 us a layer on these CPUs: 0.75 ms a forward for SmolLM2)
        for packed in layers:
            vars(packed.module)["forward"] = packed.forward
        try:
            yield
        finally:
            for packed in layers:
                vars(packed.module).pop("forward", None)
