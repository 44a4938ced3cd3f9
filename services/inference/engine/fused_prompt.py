"""The prompt chunks through one lean forward (the default on CPUs; the model families of ``layer_ops.py``).

Every first token waits for its prompt's forward: under a burst of 16 requests that is one
forward of ~250 new tokens, and through the Hugging Face modules about a third of it went
around the products (SmolLM2-135M on 2 Xeon cores with AMX, bf16 prompt products: 150 ms, of
which the products 72 ms; the rest ~1,200 ATen calls: seven products a layer each cast to bf16,
padded to whole 64-row blocks, cut back and cast to fp32; RoPE's slices and cats; module and
hook dispatch). This forward computes the same layers the way the lean decode forward does
(``fused_decode.run_layers``), with the prompt kernel of the layers (``BlockedBF16``, or
``OneDNNPacked`` in the model's dtype):

- q/k/v are one product and gate/up another (their weights side by side), so a layer multiplies
  4 times, not 7, and each product's input is cast and padded once;
- RoPE, the KV writes and the attention are the engine's own (``SlabKVCache.update``,
  ``ragged.prefill_attention``: the eager forward's batch-invariant attention of prompt chunks);
- the embeddings, the final norm and the output head are the model's modules (the head's prompt
  rows in the model's dtype, as in the eager forward), LoRA on the embeddings through the
  runner's hooks; LoRA rows on the projections get each adapter's modules on a product as two
  stacked products (``StackedDeltas``: PEFT's mixed-batch deltas within rounding, one gather and
  scatter an adapter and product instead of one per module).

Where the native module is built with its own operations (``native.prompt_own``, AVX2) and the
prompt products are bf16 blocks or the decode blocks times int8 rows (``prompt_dtype`` int8: the
layers' one kernel, whose side-by-side weights the decode forward shares), the layers run in C++:
the same products, the decode loop's own norms, RoPE with the key/value writes, SiLU and LoRA
rows (row by row) between them (a 16-prompt burst: 96 ms against 115 in the Python loop and 144
through the Hugging Face modules; ``benchmarks.inference.step --prompts``), and on AVX-512 CPUs
their own attention (the plan's prompt attention ``own``: blocks of prompt tokens over blocks of
keys with an online softmax, no score matrix, mask or key gather; a 1,500-token prompt of a
Qwen3-0.6B-sized model on 2 Xeon cores: 1.7 s of attention in ATen's products, 1.1 s in ours),
elsewhere the same attention as ATen calls.

Numbers: in the Python loop each operation is the eager forward's on the same values, except that
q/k/v and gate/up multiply side by side. A product's output column depends on its own weight row
only where the kernel's blocking does not change with the number of output columns: on an AMX
Xeon the side-by-side bf16 products in 64-row blocks give the separate products' bits (and this
forward the eager forward's logits and keys/values bit for bit, ``test_fused_prompt.py``); with
larger blocks, the C++ loop's own operations or other CPUs they may differ in their last bits.
Either way each prompt token's numbers depend on that token alone (every operation computes each
row on its own, the products in blocks whose size does not change a row's bits), so greedy output
is the same alone as in a batch, and every prompt token takes this forward whatever shares its
step: a prefix cached from one prompt is what another's forward would have computed.

Where the model or its kernels do not fit (``unsupported``), the plan keeps prompt chunks on the
eager forward; where the adapters loaded do not (``fused_decode.lora_unsupported``), the runner
resolves its plan again with them there, until the adapters are unloaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from services.inference.engine import native as native_module
from services.inference.engine import ragged
from services.inference.engine.fused_decode import (
    NO_SCALES,
    LeanLayers,
    ModuleDeltas,
    Rope,
    SideBySide,
    base_linear,
    embed,
    layer_kernels,
    logits,
    lora_layer,
    rope_tables,
    run_layers,
)
from services.inference.engine.layer_ops import LayerOps, layer_ops, projection
from services.inference.engine.lora_rows import LoraRows, Stacked
from services.inference.engine.packed_linear import OneDNNPacked, RowKernel
from services.inference.engine.quantized_linear import BlockedBF16, ByTokenKind, Int4Blocks, Q8Rows

if TYPE_CHECKING:
    from services.inference.engine.runner import ModelRunner

# the decode blocks times int8 rows, which prompt rows take too under prompt_dtype int8 (their
# kernels, and the plan's names of them)
INT8_ROWS = (Int4Blocks, Q8Rows)
INT8_ROWS_NAMES = ("int4-q8", "q8_0-int8")


def prompt_kernel_of(kernel: Any) -> RowKernel | None:
    """A kernel of the kind a layer multiplies prompt tokens with (for weights side by side), where
    the lean forward has it (a bf16 block kernel, oneDNN's packed product in the model's dtype, or
    the decode blocks times int8 rows: ``Int4Blocks``, ``Q8Rows``), else None."""
    prompt = kernel.prompt if isinstance(kernel, ByTokenKind) else kernel
    # exactly these classes (BF16Packed, a OneDNNPacked too, pairs lone rows unprobed)
    if type(prompt) is BlockedBF16:
        return BlockedBF16(prompt.batch_hint)
    if type(prompt) is OneDNNPacked:
        return OneDNNPacked(prompt.batch_hint)
    if type(prompt) in INT8_ROWS:
        return cast("RowKernel", type(prompt)())
    return None


def unsupported(ops: LayerOps | str, device: torch.device, layer_prompt: str) -> str | None:
    """Why prompt chunks cannot take the lean forward (None: they can), from the model's family
    (``layer_ops``: its config's), where it runs and the decoder layers' prompt kernels (the plan's
    ``layer_prompt``: one name, or several joined by ``|``): bf16 blocks or oneDNN's packed
    product in the model's dtype (``onednn-*``), or the decode blocks times int8 rows
    (``int4-q8``, ``q8_0-int8``: prompt_dtype int8), in every layer."""
    if isinstance(ops, str):
        return ops
    if device.type != "cpu":
        return (
            f"prompt products are oneDNN's or the own int8 rows' CPU kernels; the model runs on {device.type}"
        )
    kernels = layer_prompt.split("|")
    if any(not k.startswith("onednn-") and k not in INT8_ROWS_NAMES for k in kernels):
        return (
            f"the decoder layers' prompt tokens multiply with {layer_prompt}, not a packed bf16 or "
            "model-dtype kernel nor int4/Q8_0 blocks times int8 rows"
        )
    if len(kernels) > 1:
        return "the layers' prompt kernels differ"
    return None


class StackedDeltas:
    """The LoRA rows' deltas on a side-by-side product through each adapter's ``Stacked`` matrices
    (one gather, two products and one scatter an adapter and product instead of that many per
    module: at a 16-prompt burst with half the prompts on a q/k/v/o adapter, the per-module
    deltas cost a third of the forward); modules in training mode (dropout) per module."""

    def __init__(self, rows: LoraRows, stacks: dict[tuple[int, str], Stacked | None]) -> None:
        self.rows = rows
        self.stacks = stacks  # by (id of the product, adapter), made when first asked

    def add(self, product: SideBySide, x: torch.Tensor, out: torch.Tensor) -> None:
        layers = [lora_layer(m) for m in product.modules]
        if any(layer is not None and layer.training for layer in layers):
            ModuleDeltas(self.rows).add(product, x, out)
            return
        for name in self.rows.rows:
            key = (id(product), name)
            if key not in self.stacks:
                self.stacks[key] = Stacked.of(layers, product.sizes, name)
            stacked = self.stacks[key]
            if stacked is not None:
                self.rows.add_stacked(name, stacked, x, out)
            else:  # no module of the adapter here, or one with biases: PEFT's way, module by module
                ModuleDeltas(LoraRows({name: self.rows.rows[name]})).add(product, x, out)


class FusedPrompt(LeanLayers):
    """Prompt chunks through the lean forward (see the module doc)."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        native: bool = False,
        own_attention: bool = False,
        decode: LeanLayers | None = None,
    ) -> None:
        # a kernel of the layers' own kind for the side-by-side weights (BlockedBF16 probes each
        # one's blocks when it prepares it)
        ops = layer_ops(runner.config, runner.decoder.layers)
        first = ops.attention[0] if not isinstance(ops, str) else "q_proj"
        kernel = prompt_kernel_of(
            layer_kernels(runner).get(id(base_linear(projection(runner.decoder.layers[0], first))))
        )
        assert kernel is not None, "FusedPrompt needs a runner whose plan names a lean prompt forward"
        # the decode forward's weights where prompt rows multiply with the decode blocks (one copy)
        super().__init__(runner, kernel, share=decode)
        # the layers in C++ (``native.prompt_own``: bf16 block products, decode_own's operations
        # between them) where the runner's plan says ``native`` (the plan checked the kernels, the
        # model's sizes and the build)
        self.native = native
        # the C++ layers attend the prompt rows with their own kernel (the plan's prompt attention
        # ``own``: AVX-512), else with ragged's prefill_attention as ATen calls
        self.own_attention = own_attention
        # the adapters' stacked matrices (StackedDeltas), and the state of each adapter's
        # weights they were made from
        self._stacks: dict[tuple[int, str], Stacked | None] = {}
        self._adapter_state: dict[str, tuple[int, int]] = {}

    def refresh(self, lora_problem: str | None = None) -> None:
        super().refresh(lora_problem)
        self._stacks = {}
        self._adapter_state = {}

    def _deltas(self, lora: LoraRows) -> StackedDeltas:
        """The deltas of this forward's adapters, their stacks made again for an adapter whose
        weights were replaced or changed in place since."""
        for name in lora.rows:
            state = self._native_lora.state(name)
            if self._adapter_state.get(name) != state:
                self._stacks = {k: v for k, v in self._stacks.items() if k[1] != name}
                self._adapter_state[name] = state
        return StackedDeltas(lora, self._stacks)

    def __call__(self, plan: ragged.RaggedPlan, lora: LoraRows | None = None) -> torch.Tensor:
        """Logits ``[P, V]`` at each chunk's last token of a plan of prompt chunks only, inside
        ``ragged.active(plan)``, the runner's adapter routing and its packed products (for the
        embeddings and head)."""
        runner = self.runner
        self._fresh()
        x = embed(self.decoder, self.ops, plan.input_ids.view(-1))
        rope = rope_tables(self.decoder, self.ops, x, plan)
        if self.native:
            x = self._native(plan, x, rope, lora)
        else:
            deltas = None if lora is None else self._deltas(lora)
            x = run_layers(self.layers, plan, ragged.prefill_attention, x, rope, deltas, runner.cache)
        return logits(runner, x.index_select(0, plan.logit_rows))

    def _native(
        self,
        plan: ragged.RaggedPlan,
        x: torch.Tensor,
        rope: Rope,
        lora: LoraRows | None,
    ) -> torch.Tensor:
        """The layers through ``native.prompt_own``."""
        norms, packed, seconds, biases, qk_norms = self.native_args()
        # a product's second part: bf16 blocks' row count, or the int8 rows' kernels' scales
        blocks = [b if isinstance(b, int) else 0 for b in seconds]
        scales = [NO_SCALES if isinstance(b, int) else b for b in seconds]
        assert plan.prefill_slots is not None and plan.gather is not None and plan.valid is not None
        first = self.layers[0]
        cache = self.runner.cache
        group = first.heads // first.kv_heads
        # each layer's bias: a windowed layer's masks the keys past its window (ragged.windowed)
        attention_biases = [
            ragged.prefill_bias_for(
                plan if layer.window is None else ragged.windowed(plan, layer.window),
                x.dtype,
                first.kv_heads,
                group,
            )
            for layer in self.layers
        ]
        return native_module.prompt_own()(
            x,
            *self.native_rope(rope),
            norms,
            qk_norms,
            packed,
            blocks,
            scales,
            biases,
            cache.k,
            cache.v,
            plan.write_slots,
            plan.write_positions,
            plan.prefill_slots,
            plan.gather,
            plan.valid,
            attention_biases,
            plan.width,
            plan.prefill_len,
            ragged.KEY_BLOCK,
            first.heads,
            first.kv_heads,
            first.head_dim,
            sum(first.gate_up.sizes) // 2,
            *self.native_sizes(),
            # each layer's sliding window (0: full attention), for the C++ loop's own attention
            [layer.window or 0 for layer in self.layers],
            self.own_attention,
            *self._native_lora.columns(lora),
        )
