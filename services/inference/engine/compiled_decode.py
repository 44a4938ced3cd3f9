"""``torch.compile`` of the torch engine's decode step (a forward plan with ``decode="compiled"``).

A decode step of a small model on a CPU is many small operations: SmolLM2-135M at one row
runs ~210 matrix products and ~3,000 other ATen calls (norms, RoPE, casts, residual adds,
views) through the Hugging Face modules' Python, and the products are only about half of
its time. Inductor fuses the small operations into a few C++ loops and runs the step as one
graph; the Python of the modules runs once, at tracing.

What is compiled, and what is not:

- Only *pure decode steps of the base model*: every running sequence decodes one token,
  slot ``r`` in batch row ``r`` (the scheduler keeps running sequences in slots ``0..N-1``),
  and no LoRA layer is in the model. A step with prompt chunks (an arrival), or with LoRA
  layers loaded, runs the eager forward as before: those steps are rarer and their shapes
  (chunk lengths, the adapters' per-row routing) would recompile without end.
- The linear layers' products are the engine's own prepared kernels, as in eager mode (a
  weight the trainer changed in place is prepared again before the step). Weight-only
  int4/int8 products (``TANDEM_INFERENCE_QUANTIZE``) are plain ATen ops on plain tensors and
  are traced into the graph (inductor calls the same kernel from C++). oneDNN-packed
  products (fp32 layers, the bf16 output head) go through the opaque custom op
  ``tandem::prepared_linear``: inductor cannot take oneDNN's packed tensors. (Making every
  product opaque was measured: the op's Python dispatch, ~210 times a step, ate the gain:
  16.6 ms a step at one row vs 13.5 eager and 11.6 traced.)
- Attention (``ragged.ragged_attention``) reads the step's mask from the forward's keyword
  arguments (``tandem_decode_mask``, which transformers hands down to the attention
  function) instead of the plan's context variable, so dynamo traces it; it is the same
  SDPA call on the same view of the slab as the eager decode branch.

Shapes: compiled with ``dynamic=True``, so the batch (2..max), the attended length and the
slab's capacity are symbols: one graph for one row (dynamo specialises sizes 0 and 1) and
one for every other batch. Both are compiled at start-up (``warm_up``, logged with their
times), never inside a request. ``fullgraph=True``: a graph break is an error at warm-up
(start-up stops naming the setting), not a silent slow path. Recompiles are bounded by
dynamo's ``recompile_limit`` (raised here to ``RECOMPILE_LIMIT`` for the code object all
engines of a process share); past it dynamo runs the step eagerly.

Numbers: the products are the eager kernels; inductor's fused elementwise code (RMSNorm,
RoPE, SiLU) may round differently in the last bit from ATen's, as between any two CPU
builds. Greedy output equals the eager engine's on the tests' models
(``tests/inference/test_compiled_decode.py``); on SmolLM2 with int4 decode, where activations
are rounded to bf16 before each product, a last-bit difference can move a logit by one bf16
step and flip a near tie (1 of 3 prompts differed at token 19 of 48). A step runs compiled
or eager by what shares it (an arrival makes it a mixed, eager step), so a request's greedy
tokens alone and in a batch can differ at such a tie; measured on 10 SmolLM2 prompts (48
tokens, 4 slots): 4 differ compiled. The eager engine is batch-invariant bit for bit
(``ragged.invariant_attention``); the compiled step keeps SDPA (whose result for a row depends
on the attended length and the row count) and inductor's own fused code, so compiling trades
that invariance for its speed.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

import torch
from torch.fx.experimental import _config as fx_config

from services.inference.engine.quantized_linear import ByTokenKind, Int4WeightOnly, Int8WeightOnly

if TYPE_CHECKING:
    from services.inference.engine.packed_linear import _Packed
    from services.inference.engine.ragged import DecodeRow
    from services.inference.engine.runner import ModelRunner

Compile = Literal["off", "decode"]

log = logging.getLogger("tandem.engine.compiled_decode")

# two graphs per engine (one row, more rows); registered full models each add an engine
RECOMPILE_LIMIT = 32

# The prepared products the compiled graphs call, by handle: the layer (weakly: an engine
# that is dropped takes its layers with it) and its output size, for the fake kernel.
_PRODUCTS: dict[int, tuple[weakref.ref[_Packed], int]] = {}
_handles = itertools.count()


def _decode_product(packed: _Packed, x: torch.Tensor) -> torch.Tensor:
    kernel, prepared = packed.kernel, packed.current()
    if isinstance(kernel, ByTokenKind):
        # every token of a compiled step is a decode token: the decode-side kernel of a layer
        # that multiplies prompt and decode tokens differently (quantised decode, fp32 prompts)
        return kernel.decode.apply(x, kernel.decode_side(prepared), packed.module.bias)
    return kernel.apply(x, prepared, packed.module.bias)


@torch.library.custom_op("tandem::prepared_linear", mutates_args=())
def prepared_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """One layer's product with its prepared weight (the eager engine's kernel, outside the graph)."""
    packed = _PRODUCTS[handle][0]()
    if packed is None:
        raise RuntimeError(f"prepared linear layer {handle} is gone (its engine was dropped)")
    return _decode_product(packed, x)


@prepared_linear.register_fake
def _prepared_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _PRODUCTS[handle][1])


class CompiledDecode:
    """The compiled decode step of one ``ModelRunner`` (see the module doc)."""

    def __init__(self, runner: ModelRunner, *, trace_weight_only: bool = True) -> None:
        import torch._dynamo

        self.runner = runner
        self.trace_weight_only = trace_weight_only
        self._forwards: dict[int, tuple[weakref.ref[_Packed], Callable[[torch.Tensor], torch.Tensor]]] = {}
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self._compiled = torch.compile(self._step, dynamic=True, fullgraph=True)
        self.compile_seconds: dict[str, float] = {}
        self.warmed = False

    def accepts(self, decode: list[DecodeRow], lora_layers: bool) -> bool:
        """Whether a forward of exactly these decode tokens (no prompt chunk) runs compiled."""
        return (
            bool(decode)
            and not lora_layers
            and all(r.adapter is None and r.slot == i for i, r in enumerate(decode))
        )

    def _forward_of(self, packed: _Packed) -> Callable[[torch.Tensor], torch.Tensor]:
        # one function per layer, made once: dynamo guards on the module's forward, so a new
        # one each step would recompile each step (the weak reference tells a reused id apart)
        known = self._forwards.get(id(packed))
        if known is not None and known[0]() is packed:
            return known[1]
        kernel = packed.kernel
        by_kind = isinstance(kernel, ByTokenKind)
        decode = kernel.decode if isinstance(kernel, ByTokenKind) else kernel
        forward: Callable[[torch.Tensor], torch.Tensor]
        if self.trace_weight_only and isinstance(decode, (Int4WeightOnly, Int8WeightOnly)):
            # a plain ATen op on plain tensors: in the graph, called from C++ (``_active``
            # prepares the weight before each step, so a changed weight is quantised again)
            def forward(x: torch.Tensor) -> torch.Tensor:
                prepared = packed.weight.decode if by_kind else packed.weight
                return decode.apply(x, prepared, packed.module.bias)

        else:
            handle = next(_handles)
            _PRODUCTS[handle] = (weakref.ref(packed), packed.module.out_features)

            def forward(x: torch.Tensor) -> torch.Tensor:
                return torch.ops.tandem.prepared_linear(x, handle)

        self._forwards[id(packed)] = (weakref.ref(packed), forward)
        return forward

    @contextmanager
    def _active(self) -> Iterator[None]:
        runner = self.runner
        layers = runner.packed.layers if runner.packed is not None else []
        for packed in layers:
            prepared = packed.current()
            if isinstance(packed.kernel, ByTokenKind):
                packed.kernel.decode_side(prepared)  # the traced forward reads it
            packed.module.forward = self._forward_of(packed)  # type: ignore[method-assign,assignment]
        try:
            with runner._ragged_attention():
                yield
        finally:
            for packed in layers:
                vars(packed.module).pop("forward", None)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        out = runner.decoder(
            input_ids=input_ids,
            attention_mask=runner._no_mask,
            position_ids=positions,
            use_cache=True,
            tandem_decode_mask=mask,
            **{runner._cache_kwarg: runner.cache},
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return runner.lm_head(hidden[:, 0])

    def __call__(self, decode: list[DecodeRow]) -> torch.Tensor:
        """Logits ``[B, V]`` of one pure decode step (``accepts`` said yes)."""
        if not self.warmed:
            # an engine used without ``start`` (the trainer's): compile now, and say so
            log.info("compiling the decode step inside the first decode forward (engine not started)")
            self.warm_up()
        runner = self.runner
        device = runner.device
        positions = torch.tensor([r.position for r in decode], dtype=torch.long, device=device)
        length = int(positions.max()) + 1
        runner.cache.ensure_capacity(length)
        runner.cache.plan_writes(torch.arange(len(decode), device=device), positions)
        keys = torch.arange(length, device=device)
        # row r attends its keys up to its own position (the eager decode mask, same shape)
        mask = (keys.unsqueeze(0) <= positions.unsqueeze(1)).view(len(decode), 1, 1, length)
        input_ids = torch.tensor([[r.token] for r in decode], dtype=torch.long, device=device)
        # no duck sizing: a size met at tracing that equals another (an attended length of 3
        # and SmolLM2's 3 key/value heads) would otherwise become one symbol, and the next
        # step, where they differ, would compile again
        with self._active(), fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return self._compiled(input_ids, positions.unsqueeze(1), mask)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile both graphs now (one row; several rows) on scratch decode tokens in slots
        0 and 1 at position 2; what those write is put back afterwards (a lazy warm-up runs
        while sequences hold those slots)."""
        self.warmed = True
        cache = self.runner.cache
        slots = min(2, cache.max_slots)
        position = 2  # attended lengths of 0 or 1 would specialise the graph
        cache.ensure_capacity(position + 1)
        saved = [store[:slots, :, position].clone() for store in (*cache.k, *cache.v)]
        try:
            self._compile(slots, position)
        except Exception as exc:  # a graph break (fullgraph) or a failing compiler: name the setting
            raise RuntimeError(f"decode='compiled': compiling the decode step failed: {exc}") from exc
        finally:
            for store, kept in zip((*cache.k, *cache.v), saved, strict=True):
                store[:slots, :, position] = kept

    def _compile(self, slots: int, position: int) -> None:
        from services.inference.engine.ragged import DecodeRow

        for rows in range(1, slots + 1):
            start = time.perf_counter()
            self([DecodeRow(slot=s, token=0, position=position) for s in range(rows)])
            name = "1 row" if rows == 1 else f"2..{self.runner.cache.max_slots} rows"
            self.compile_seconds[name] = time.perf_counter() - start
            log.info("compiled the decode step for %s in %.1f s", name, self.compile_seconds[name])
