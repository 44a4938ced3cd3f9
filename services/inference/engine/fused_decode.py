"""The decode tokens through one lean forward (int4 decode or the model's own weights, the default).

A decode step of a small model on a CPU spends more time around its products than in them:
SmolLM2-135M at one row ran 210 int4 products and ~4,800 other ATen calls a step through the
Hugging Face modules (casts to bf16 and back for every product, RoPE's slices and cats, views,
module and hook dispatch), and the products were under a third of the step. This forward
computes the same decoder layers with the same operations on the same values, without the
modules' plumbing:

- q/k/v are one int4 product and gate/up another (their weights side by side, so a layer
  multiplies 4 times, not 7), each product's input made into the kernel's rows once (bf16 for
  torch's int4 kernel; fp32 for ``Int4Blocks``, which quantises them itself), not once per
  projection;
- RoPE, the KV writes and the attention are the engine's own (``SlabKVCache.update``,
  ``ragged.ragged_attention``: the batch-invariant attention of the eager forward);
- the embeddings, the final norm and the output head are the model's modules, called as the
  eager forward calls them (a LoRA adapter on them applies through the runner's hooks).

**The same numbers as the eager forward, bit for bit**, for every decode token: each
operation is the one the Hugging Face modules run on the same values (an int4 product's output
column depends only on its own weight row, so multiplying q, k and v side by side gives each
the values it gets alone; ``test_fused_decode.py`` checks logits and KV writes bit for bit
against the eager forward, with and without LoRA rows). So greedy output, batch invariance
and the engine's other tests hold unchanged; only the time goes.

LoRA rows: each adapter's delta is added to its rows' slice of the fused products exactly as
PEFT's mixed batch does (``lora_B(lora_A(x[rows])) * scaling`` added to the base result in
its dtype). Adapters of another kind (DoRA and PEFT's other variants), LoRA layers on other
modules of a decoder layer, or a model whose adapters are not routed per row (the trainer's
in-process engine uses its model's active adapter) make ``lora_unsupported`` name the reason, and
the runner resolves its plan again with decode steps on the eager forward (logged; unloading the
adapter restores the plan). A model or kernels outside the lean forward (``unsupported``: the
family's operations, the device and dtype, the plan's kernel names) keep the eager forward in the
plan from the start.

The layer is Llama's, with the operations of the model's family (``layer_ops.py``: norm placement
and weights from 1, the activation, q/k norms, multipliers, the RoPE table of each layer, fused
projections); a family outside it, or an operation the loop does not have, keeps the eager forward
with the reason. With the model's own weights (no quantisation) the products are oneDNN's packed
ones in the model's dtype, as the eager forward multiplies them.

The loop over the layers runs in C++ where the plan says ``native-own`` (``native.py``: the module
built, AVX2 CPUs; the default; ``own_unsupported``: the model's sizes fit it; not in training
mode), with its own operations between the products (``decode_own``: int4, or oneDNN's of the
model's own fp32 or bf16 weights; a bf16 model's KV slabs stay bf16, its residual stream goes
through the loop in fp32), which
are not the eager forward's last bits but keep each row's numbers independent of the batch
(``test_native_own.py``); the Python loop here is the bit-exact reference.

The int4 kernel is the plan's (``decode_kernel``): ``Int4Blocks`` (Q4_1 groups times int8 rows,
the native module's ``q4_linear``) where that module is built, torch's int4 kernel elsewhere;
the C++ and Python loops multiply with the same one.

Prompt chunks take their own lean forward (``fused_prompt.py``; bf16 oneDNN products, faster at
many rows): a step with prompt chunks and decode tokens runs the two forwards over disjoint
slots, so a decode token's numbers never depend on what shares its step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F

from services.inference.engine import native, ragged
from services.inference.engine.kv_cache import SlabKVCache
from services.inference.engine.layer_ops import (
    DEFAULT_ROPE,
    LayerOps,
    final_logits,
    layer_ops,
    norm_eps,
    norm_weight,
    projection,
)
from services.inference.engine.lora_rows import LoraRows
from services.inference.engine.packed_linear import OneDNNPacked, RowKernel
from services.inference.engine.prefix_cache import tensors_state
from services.inference.engine.quantized_linear import (
    INT4_GROUP,
    ByTokenKind,
    Int4Blocks,
    Int4WeightOnly,
    Q8Rows,
)

if TYPE_CHECKING:
    from services.inference.engine.runner import ModelRunner

_INT4 = Int4WeightOnly()
# ragged's attention of one kind of token: (plan, queries [T, H, d], key slab, value slab, scaling)
Attention = Callable[
    [ragged.RaggedPlan, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor
]


def base_linear(module: Any) -> torch.nn.Linear:
    """The plain linear layer under a PEFT LoRA wrapper (or the layer itself)."""
    return getattr(module, "base_layer", module)


def lora_layer(module: Any) -> Any | None:
    """The PEFT LoRA layer wrapping a projection, if any."""
    return module if hasattr(module, "lora_A") and hasattr(module, "base_layer") else None


class SideBySide:
    """Several projections of one input as one product: their weights stacked by output rows
    (their biases too), prepared by ``kernel`` (int4 for decode tokens; the prompt kernel in
    ``fused_prompt.py``) and prepared again when any weight changes in place (the trainer)."""

    def __init__(self, layer: Any, names: tuple[str, ...], kernel: RowKernel = _INT4) -> None:
        self.names = names
        self.kernel = kernel
        self.key: tuple[tuple[int, int], ...] | None = None
        self.prepared: Any = None
        self.bias: torch.Tensor | None = None
        self.use(layer)

    def use(self, layer: Any) -> None:
        """Read the projections from ``layer`` again (PEFT wraps and unwraps them)."""
        self.modules = [projection(layer, name) for name in self.names]
        self.linears = [base_linear(m) for m in self.modules]
        self.sizes = [lin.out_features for lin in self.linears]

    def current(self) -> tuple[Any, torch.Tensor | None]:
        """The prepared weight and bias, prepared again if a weight changed since."""
        linears = self.linears
        key = tuple((lin.weight.data_ptr(), lin.weight._version) for lin in linears)
        if key != self.key:
            with torch.no_grad():
                self.prepared = self.kernel.prepare(torch.cat([lin.weight.detach() for lin in linears]))
                biases = [lin.bias for lin in linears]
                self.bias = (
                    None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
                )
            self.key = key
        return self.prepared, self.bias

    def __call__(
        self, x: torch.Tensor, rows: torch.Tensor, lora: ProductDeltas | None, *, keep: bool = False
    ) -> torch.Tensor:
        """The product of ``x`` ``[n, in]``, given as ``rows`` (``kernel.rows(x)``, made once by the
        caller for every product of that input), in ``x``'s dtype; or, with ``keep`` and nothing to
        add to it, as the kernel gives it (bf16: a caller adding it to an fp32 tensor gets the same
        sums, as type promotion widens it exactly, and one cast a layer is saved)."""
        out = self.kernel.product(rows, self.prepared)
        if out.shape[0] != x.shape[0]:  # a kernel's padding rows
            out = out[: x.shape[0]]
        bias = self.bias
        if keep and bias is None and lora is None:
            return out
        out = out.to(x.dtype)
        if bias is not None:
            out = out + bias
        if lora is not None:
            lora.add(self, x, out)
        return out


class ProductDeltas(Protocol):
    """How a lean forward adds the LoRA rows' deltas to a side-by-side product."""

    def add(self, product: SideBySide, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the deltas of ``x`` ``[n, in]`` to ``out`` ``[n, product's columns]``."""
        ...


class ModuleDeltas:
    """Each LoRA module's deltas added to its slice of the product as PEFT's mixed batch adds them
    (``LoraRows.add``): the eager forward's numbers."""

    def __init__(self, rows: LoraRows) -> None:
        self.rows = rows

    def add(self, product: SideBySide, x: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for module, size in zip(product.modules, product.sizes, strict=True):
            layer = lora_layer(module)
            if layer is not None:
                self.rows.add(layer, x, out[:, start : start + size])
            start += size


@dataclass
class _Layer:
    module: Any
    qkv: SideBySide
    o: SideBySide
    gate_up: SideBySide
    down: SideBySide
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    ops: LayerOps
    # the norms before attention, on its output (sandwich), before the MLP, on its output
    norms: tuple[Any, Any | None, Any, Any | None]
    qk_norms: tuple[Any, Any] | None  # RMSNorm of each query / key head before RoPE
    rope: str | None  # the RoPE table this layer takes (None: no RoPE)
    window: int | None = None  # its sliding attention window (None: full attention)

    def products(self) -> tuple[SideBySide, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


# a layer's RoPE: cos and sin [T, 1, rotary dims] (sin's first half negated, see rope_tables), or
# None for a layer without RoPE
Rope = list[tuple[torch.Tensor, torch.Tensor] | None]


def _rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on heads ``[T, H, d]``: rotate_half(x) * sin as roll(x, r/2) * sin over the table's ``r``
    rotary dims (all of them, or the first ``r`` of a partial RoPE, the rest passed as they are)."""
    rotary = cos.shape[-1]
    if rotary == qk.shape[-1]:
        return (qk * cos) + (torch.roll(qk, rotary // 2, -1) * sin)
    part = qk[..., :rotary]
    return torch.cat(((part * cos) + (torch.roll(part, rotary // 2, -1) * sin), qk[..., rotary:]), dim=-1)


def run_layers(
    layers: list[_Layer],
    plan: ragged.RaggedPlan,
    attention: Attention,
    x: torch.Tensor,
    rope: Rope,
    lora: ProductDeltas | None,
    cache: SlabKVCache,
) -> torch.Tensor:
    """The decoder layers on the residual stream ``x`` ``[T, hidden]`` (the lean forwards' Python
    loop): ``attention`` is ``ragged``'s for the plan's kind of token, ``rope`` ``rope_tables``'.
    A layer's operations are its family's (``layer_ops``); Llama's are the eager forward's own. A
    layer with a sliding window attends the plan's ``ragged.windowed`` form."""
    tokens = x.shape[0]
    for index, layer in enumerate(layers):
        ops = layer.ops
        attn_in, attn_out, mlp_in, mlp_out = layer.norms
        kernel = layer.qkv.kernel
        residual = x
        h = _rms_norm(attn_in, x, ops)
        # the products kept as the kernel gives them (bf16) where nothing is added to them: the
        # fp32 operations they meet widen them exactly, as the cast to fp32 would
        qkv = layer.qkv(h, kernel.rows(h), lora, keep=True)
        nq, nk = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
        qk = qkv[:, : nq + nk].view(tokens, layer.heads + layer.kv_heads, layer.head_dim)
        if layer.qk_norms is not None:
            q_norm, k_norm = layer.qk_norms
            qk = qk.to(x.dtype)
            qk = torch.cat(
                (_rms_norm(q_norm, qk[:, : layer.heads], ops), _rms_norm(k_norm, qk[:, layer.heads :], ops)),
                1,
            )
        table = rope[index]
        if table is not None:
            # RoPE on the query and key heads together (elementwise: each head's values as alone)
            qk = _rope(qk, *table)
        qk = qk.to(x.dtype)
        q, k = qk[:, : layer.heads], qk[:, layer.heads :]
        v = qkv[:, nq + nk :].view(tokens, layer.kv_heads, layer.head_dim).to(x.dtype)
        k_slab, v_slab = cache.update(k.unsqueeze(2), v.unsqueeze(2), index)
        attended = plan if layer.window is None else ragged.windowed(plan, layer.window)
        attn = attention(attended, q, k_slab, v_slab, layer.scaling).reshape(tokens, nq)
        x = _residual(residual, layer.o(attn, kernel.rows(attn), lora, keep=True), attn_out, ops)
        residual = x
        h = _rms_norm(mlp_in, x, ops)
        gate_up = layer.gate_up(h, kernel.rows(h), lora, keep=True)
        size = gate_up.shape[-1] // 2
        gate = gate_up[:, :size].to(x.dtype)
        gated = F.silu(gate) if ops.activation == "silu" else F.gelu(gate, approximate="tanh")
        act = (gated * gate_up[:, size:]).to(x.dtype)
        x = _residual(residual, layer.down(act, kernel.rows(act), lora, keep=True), mlp_out, ops)
    return x


def _residual(residual: torch.Tensor, out: torch.Tensor, norm: Any | None, ops: LayerOps) -> torch.Tensor:
    """The residual stream after a branch: its output normed (sandwich) and scaled (Granite)."""
    if norm is None and ops.residual_multiplier == 1.0:
        return residual + out
    out = out.to(residual.dtype)
    if norm is not None:
        out = _rms_norm(norm, out, ops)
    if ops.residual_multiplier != 1.0:
        out = out * ops.residual_multiplier
    return residual + out


def rope_tables(decoder: Any, ops: LayerOps, x: torch.Tensor, plan: ragged.RaggedPlan) -> Rope:
    """Each layer's RoPE cos and sin ``[T, 1, r]`` at the plan's positions (one computation per
    distinct table: Gemma 3's local and global bases), sin with its first half negated:
    rotate_half(x) * sin is then roll(x, r/2) * sin, the same products (a negation is exact) in two
    operations a layer instead of five."""
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in set(ops.rope) - {None}:
        assert name is not None
        cos, sin = (
            decoder.rotary_emb(x, plan.positions)
            if name == DEFAULT_ROPE
            else decoder.rotary_emb(x, plan.positions, name)
        )
        half = sin.shape[-1] // 2
        tables[name] = (cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))
    return [None if name is None else tables[name] for name in ops.rope]


def embed(decoder: Any, ops: LayerOps, ids: torch.Tensor) -> torch.Tensor:
    """The embeddings of ``ids`` as the model's decoder takes them (Granite's multiplier applied;
    Gemma's scale is its embedding module's own)."""
    x = decoder.embed_tokens(ids)
    return x * ops.embedding_multiplier if ops.embedding_multiplier != 1.0 else x


def logits(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    """The final norm, the output head and the model's own steps after it (``final_logits``)."""
    return final_logits(runner.config, runner.lm_head(runner.decoder.norm(hidden)))


def _rms_norm(norm: Any, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
    # one fused kernel, the same values as LlamaRMSNorm's five operations on fp32 rows (checked
    # bit for bit by the tests against the eager forward); Gemma's weight counts from 1
    return F.rms_norm(x, x.shape[-1:], norm_weight(norm, ops), norm_eps(norm))


def layer_kernels(runner: ModelRunner) -> dict[int, Any]:
    """The kernel each base linear layer of the runner's products has, by module id."""
    return {id(p.module): p.kernel for p in runner.packed.layers} if runner.packed is not None else {}


def _decode_side(kernel: Any) -> Any:
    return kernel.decode if isinstance(kernel, ByTokenKind) else kernel


def decode_kernel(runner: ModelRunner) -> RowKernel:
    """The kernel of the side-by-side decode products, of the kind the runner built for the layers
    (what the plan's ``layer_decode`` names): ``Int4Blocks`` where every projection has it, torch's
    int4 kernel (``Int4WeightOnly``) for other int4 layers, and oneDNN's packed product in the
    model's dtype for unquantised ones."""
    kernels = layer_kernels(runner)
    ops = layer_ops(runner.config, runner.decoder.layers)
    names = ops.projections if isinstance(ops, LayerOps) else ()
    decodes = [
        _decode_side(kernels.get(id(base_linear(projection(layer, name)))))
        for layer in runner.decoder.layers
        for name in names
    ]
    if decodes and all(type(k) is OneDNNPacked for k in decodes):
        return OneDNNPacked(decodes[0].batch_hint)
    if decodes and all(type(k) is Q8Rows for k in decodes):
        return Q8Rows()
    return Int4Blocks() if {type(k) for k in decodes} == {Int4Blocks} else _INT4


# the plan's names of the decode kernels the lean forward multiplies with (``plan.kernel_name``):
# torch's int4 kernel or the own Q4_1 one under int4; oneDNN's packed product in the model's dtype
INT4_KERNELS = frozenset({"int4", "int4-q8"})
# Q8_0 blocks times int8 rows (int8 decode on AVX512-VNNI; plan.kernel_name of Q8Rows)
Q8_ROWS = "q8_0-int8"


def unsupported(
    ops: LayerOps | str, device: torch.device, dtype: torch.dtype, quantize: str, layer_decode: str
) -> str | None:
    """Why decode tokens cannot take the lean forward (None: they can), from the model's family
    (``layer_ops``: its config's), where and in what dtype it runs, the quantisation and the
    decoder layers' decode kernels (the plan's ``layer_decode``: one name, or several joined by
    ``|``)."""
    if isinstance(ops, str):
        return ops
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return f"decode is not on a CPU in fp32 or bf16 ({device.type}, {dtype})"
    if quantize not in ("int4", "int8", "none"):
        return f"decode is {quantize}, not int4, int8 or the model's own weights"
    if quantize in ("int4", "int8") and dtype != torch.float32:
        return f"{quantize} decode of a model that is not fp32"
    kernels = set(layer_decode.split("|"))
    if quantize == "int4" and not kernels <= INT4_KERNELS:
        return f"the decoder layers decode with {layer_decode}, not int4 in every layer"
    if quantize == "int8" and kernels != {Q8_ROWS}:
        return (
            f"the decoder layers decode with {layer_decode}, not Q8_0 blocks times int8 rows in every layer"
        )
    # unquantised decode sides are oneDNN's packed product in the model's dtype (never bf16 blocks)
    if quantize == "none" and any(not k.startswith("onednn-") or k == "onednn-bf16-blocks" for k in kernels):
        return f"the decoder layers decode with {layer_decode}, not oneDNN's packed weights"
    return None


def lora_unsupported(model: Any, ops: LayerOps | str, layers: Any, *, routed: bool) -> str | None:
    """Why the adapters loaded on ``model`` now keep its tokens off the lean forwards (None: they
    don't): ``layers`` are its decoder's layers, ``routed`` whether its LoRA layers are routed per
    row (the runner's hooks; the trainer's in-process engine uses its model's active adapter)."""
    names = ops.projections if isinstance(ops, LayerOps) else ()
    projections = {id(projection(layer, n)) for layer in layers for n in names}
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    decoder_layers = set(map(id, layers.modules()))
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not routed:
            return "the model's adapters are not routed per row"
        if getattr(module, "lora_variant", None):
            return f"{name}: an adapter of another kind than plain LoRA ({sorted(module.lora_variant)})"
        if id(module) in decoder_layers and id(module) not in projections:
            return f"{name}: a LoRA layer on a module the lean forward does not call"
    return None


# head sizes decode_own is compiled for; its vectors take widths in multiples of 16
OWN_HEAD_DIMS = (16, 32, 64, 128)
OWN_WIDTH = 16
OWN_MAX_GROUP = 8


def own_unsupported(config: Any, dtype: torch.dtype, *, prompt: bool = False) -> str | None:
    """Why the C++ loop's own operations (``decode_own``; ``prompt``: ``prompt_own``) do not fit a
    model of ``config`` in ``dtype`` (None: they do). Decode takes fp32 and bf16 models (their
    weights as they are, the residual stream fp32); the prompt layers fp32 ones. Both read fp32 or
    bf16 KV slabs."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if head_dim not in OWN_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {list(OWN_HEAD_DIMS)}"
    if heads // kv_heads > OWN_MAX_GROUP:
        return f"{heads // kv_heads} query heads a key/value head (at most {OWN_MAX_GROUP})"
    for name in ("hidden_size", "intermediate_size"):
        if int(getattr(config, name)) % OWN_WIDTH:
            return f"{name} {getattr(config, name)} is not a multiple of {OWN_WIDTH}"
    if prompt and dtype != torch.float32:
        return f"the C++ prompt layers take fp32 models; the model is {dtype}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the C++ loop takes fp32 or bf16 weights and KV slabs; the model is {dtype}"
    rotary = rotary_dim(config)
    if rotary % OWN_WIDTH:
        return f"{rotary} rotary dimensions are not a multiple of {OWN_WIDTH}"
    return None


def rotary_dim(config: Any) -> int:
    """How many of a head's dimensions RoPE turns (all but under Phi's partial RoPE)."""
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    factor = factor if factor is not None else getattr(config, "partial_rotary_factor", 1.0)
    return int(head_dim * float(factor or 1.0))


def native_args(layers: list[_Layer]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The layers' weights as the C++ loops take them: each layer's four norm weights (before and
    after attention, before and after the MLP; None where the family has none) as they multiply,
    and each product's prepared weight in its two parts (int4: packed and scales; bf16 blocks:
    packed and block rows) and its bias."""
    norms: list[Any] = []
    first, second, biases = [], [], []
    for layer in layers:
        norms += [None if n is None else norm_weight(n, layer.ops).float().contiguous() for n in layer.norms]
        for product in layer.products():
            # int4 / Q8_0 blocks: packed and scales (Q8_0's third part, its output count, is the packed size)
            (a, b), bias = product.prepared[:2], product.bias
            if type(product.kernel) is OneDNNPacked:
                # oneDNN's packed weight and whether it pairs lone rows (the C++ loop always pairs
                # them: the same numbers): an empty second part names the kind
                b = NO_SCALES
            first.append(a)
            second.append(b)
            biases.append(bias)
    return norms, first, second, biases


NO_SCALES = torch.empty(0)


def native_layer_args(layers: list[_Layer]) -> tuple[list[Any], list[Any]]:
    """What the C++ loops read per layer besides the products: the q/k norms' weights (two a layer,
    None where the family has none) and whether the layer takes RoPE."""
    qk: list[Any] = []
    for layer in layers:
        if layer.qk_norms is None:
            qk += [None, None]
        else:
            qk += [norm_weight(n, layer.ops).float().contiguous() for n in layer.qk_norms]
    return qk, [layer.rope is not None for layer in layers]


# an entry of the C++ loops' LoRA columns: NativeLora.entries' eight fields and the adapter's rows
_LORA_FIELDS = 9


class NativeLora:
    """The LoRA modules on a lean forward's products as the C++ loops take them, made once per
    adapter and again when a weight of it was replaced or changed in place."""

    def __init__(self, layers: list[_Layer]) -> None:
        self.layers = layers
        self._modules: dict[str, list[tuple[Any, ...]]] = {}
        self._entries: dict[str, tuple[tuple[int, int], list[tuple[Any, ...]]]] = {}

    def _of(self, name: str) -> list[tuple[Any, ...]]:
        """Adapter ``name``'s LoRA modules on the products, found once: (the product's index, the
        module's columns there, its LoRA layer, A, B)."""
        modules = self._modules.get(name)
        if modules is None:
            modules = []
            for index, layer in enumerate(self.layers):
                for k, product in enumerate(layer.products()):
                    start = 0
                    for module, size in zip(product.modules, product.sizes, strict=True):
                        lora = lora_layer(module)
                        if lora is not None and name in lora.lora_A:
                            modules.append(
                                (4 * index + k, start, size, lora, lora.lora_A[name], lora.lora_B[name])
                            )
                        start += size
            self._modules[name] = modules
        return modules

    def state(self, name: str) -> tuple[int, int]:
        """Changes when a weight of adapter ``name`` was replaced or changed in place."""
        return tensors_state([m.weight for *_, a, b in self._of(name) for m in (a, b)])

    def entries(self, name: str) -> list[tuple[Any, ...]]:
        """Adapter ``name``'s deltas: per LoRA module of a product (in product order), its
        product's index, its columns there, A and B, their biases and the scaling, as the C++
        loops read them (fp32, B transposed)."""
        modules = self._of(name)
        key = self.state(name)
        cached = self._entries.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        entries = []
        for slot, start, size, lora, a, b in modules:
            a_weight, b_weight = a.weight.float().contiguous(), b.weight.t().float().contiguous()
            a_bias, b_bias = (None if m.bias is None else m.bias.float().contiguous() for m in (a, b))
            entries.append((slot, start, size, a_weight, a_bias, b_weight, b_bias, float(lora.scaling[name])))
        self._entries[name] = (key, entries)
        return entries

    def columns(self, lora: LoraRows | None) -> list[Any]:
        """The forward's LoRA entries as the C++ loops' nine argument columns: in product order
        (adapters' rows are disjoint: their order within a product changes no number), each with
        its adapter's rows."""
        entries: list[tuple[Any, ...]] = []
        for name, rows in lora.rows.items() if lora is not None else ():
            entries += [(*entry, rows) for entry in self.entries(name)]
        entries.sort(key=lambda e: e[0])
        return [list(c) for c in zip(*entries, strict=True)] if entries else [[] for _ in range(_LORA_FIELDS)]


class LeanLayers:
    """What the lean forwards share (decode tokens here, prompt chunks in ``fused_prompt.py``): the
    decoder layers' projections multiplied side by side with one kernel, prepared again when a
    weight changed in place, and the C++ loops' arguments made from them."""

    def __init__(self, runner: ModelRunner, kernel: RowKernel, share: LeanLayers | None = None) -> None:
        """``share``: another lean forward of the runner; where it multiplies with a kernel of the
        same kind (prompt rows on the decode blocks: prompt_dtype int8) its side-by-side weights
        are this forward's too, prepared once."""
        self.runner = runner
        self.decoder = runner.decoder
        config = runner.config
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        ops = layer_ops(config, self.decoder.layers)
        assert isinstance(ops, LayerOps), ops
        self.ops = ops
        self.layers: list[_Layer]
        if share is not None and type(share.layers[0].qkv.kernel) is type(kernel):
            self.layers = share.layers
        else:
            self.layers = [
                _Layer(
                    module=layer,
                    qkv=SideBySide(layer, ops.attention, kernel),
                    o=SideBySide(layer, ("o_proj",), kernel),
                    gate_up=SideBySide(layer, ops.mlp_in, kernel),
                    down=SideBySide(layer, (ops.mlp_out,), kernel),
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    scaling=float(layer.self_attn.scaling),
                    ops=ops,
                    norms=cast(
                        "tuple[Any, Any | None, Any, Any | None]",
                        tuple(None if n is None else getattr(layer, n) for n in ops.norm_names()),
                    ),
                    qk_norms=(layer.self_attn.q_norm, layer.self_attn.k_norm) if ops.qk_norm else None,
                    rope=ops.rope[index],
                    window=ops.window[index],
                )
                for index, layer in enumerate(self.decoder.layers)
            ]
        self.rotary = rotary_dim(config)
        # why the adapters loaded now keep this forward's tokens on the Hugging Face modules (the
        # plan's reason when it moved them there; the runner's ``lora_unsupported``), else None
        self.lora_problem: str | None = None
        self._multiplied: frozenset[int] | None = None
        # the state of every weight the products were prepared from (``_fresh``), and the C++
        # loops' arguments made from them
        self._fingerprint: tuple[int, int] | None = None
        self._native_args: tuple[list[Any], ...] | None = None
        self._native_lora = NativeLora(self.layers)

    def refresh(self, lora_problem: str | None = None) -> None:
        """Re-read the projections after an adapter was loaded or unloaded (PEFT wraps and
        unwraps them); ``lora_problem``: why the adapters loaded now cannot take this forward."""
        for fused in self.layers:
            for product in fused.products():
                product.use(fused.module)
        self.lora_problem = lora_problem
        self._multiplied = None
        self._fingerprint = None
        self._native_lora = NativeLora(self.layers)

    def _fresh(self) -> None:
        """Every product prepared from its weights as they are now: one pass over the weights a
        forward (an update in place by the trainer's in-process engine shows), not one check a
        product."""
        # the norms too: the C++ loops' arguments hold Gemma's 1 + weight as a copy
        fingerprint = tensors_state(
            [lin.weight for layer in self.layers for p in layer.products() for lin in p.linears]
            + [
                n.weight
                for layer in self.layers
                for n in (*layer.norms, *(layer.qk_norms or ()))
                if n is not None
            ]
        )
        if fingerprint != self._fingerprint:
            for layer in self.layers:
                for product in layer.products():
                    product.current()
            self._native_args = None
            self._fingerprint = fingerprint

    def multiplied(self) -> frozenset[int]:
        """The ids of the linear layers whose products this forward computes itself."""
        if self._multiplied is None:
            self._multiplied = frozenset(
                id(lin) for layer in self.layers for product in layer.products() for lin in product.linears
            )
        return self._multiplied

    def prepare(self) -> None:
        """Prepare every side-by-side weight now (start-up, not the first request)."""
        self._fresh()

    def native_args(self) -> tuple[list[Any], ...]:
        """``native_args`` and ``native_layer_args`` of the layers (norms, the products' two parts,
        biases, q/k norms), made again after a weight changed (``_fresh``)."""
        if self._native_args is None:
            self._native_args = (*native_args(self.layers), native_layer_args(self.layers)[0])
        return self._native_args

    def native_rope(self, rope: Rope) -> tuple[list[Any], list[Any]]:
        """The layers' RoPE tables as the C++ loops take them: cos and sin a layer, None for a layer
        without RoPE."""
        return [None if r is None else r[0] for r in rope], [None if r is None else r[1] for r in rope]

    def native_sizes(self) -> tuple[Any, ...]:
        """What the C++ loops read of the model's shapes and operations after the attention's
        sizes: the norms' epsilon, the attention's scaling, RoPE's dimensions, the residual
        multiplier and whether the MLP's activation is GELU (tanh)."""
        first = self.layers[0]
        return (
            norm_eps(first.norms[0]),
            first.scaling,
            self.rotary,
            self.ops.residual_multiplier,
            self.ops.activation == "gelu_tanh",
        )


class FusedDecode(LeanLayers):
    """Decode tokens through the lean forward (see the module doc)."""

    def __init__(self, runner: ModelRunner, *, native: bool = False) -> None:
        super().__init__(runner, decode_kernel(runner))
        # the layers' loop in C++ (``decode_own``) where the runner's plan says ``native-own``
        # (the plan checked the model's sizes and the build), else in Python
        self.native = native

    def __call__(self, plan: ragged.RaggedPlan, lora: LoraRows | None = None) -> torch.Tensor:
        """Logits ``[D, V]`` of a plan of decode tokens only, inside ``ragged.active(plan)``,
        the runner's adapter routing and its packed products (for the embeddings and head);
        ``lora``: the forward's rows by adapter (what the runner's routing yields)."""
        runner = self.runner
        cache = runner.cache
        ids = plan.input_ids.view(-1)
        self._fresh()
        x = embed(self.decoder, self.ops, ids)
        loop = native.decode_own() if self.native else None
        if loop is not None:
            # the C++ loop's residual stream and RoPE tables are fp32 (a bf16 model's too: its
            # weights and KV slabs stay bf16); its output goes on in the model's dtype
            x32 = x.float()
            hidden = self._native(loop, plan, x32, rope_tables(self.decoder, self.ops, x32, plan), lora)
            return logits(runner, hidden.to(x.dtype))
        rope = rope_tables(self.decoder, self.ops, x, plan)
        deltas = None if lora is None else ModuleDeltas(lora)
        return logits(runner, run_layers(self.layers, plan, ragged.decode_attention, x, rope, deltas, cache))

    def _native(
        self,
        loop: Any,
        plan: ragged.RaggedPlan,
        x: torch.Tensor,
        rope: Rope,
        lora: LoraRows | None,
    ) -> torch.Tensor:
        """The layers' loop in C++ (``native.decode_own``): its own operations between the products;
        each token attends its own slab row up to its position, from past a windowed layer's window
        (no plan-wide bias or view)."""
        norms, packed, scales, biases, qk_norms = self.native_args()
        columns = self._native_lora.columns(lora)
        first = self.layers[0]
        cache = self.runner.cache
        weights = (
            x,
            *self.native_rope(rope),
            norms,
            qk_norms,
            packed,
            scales,
            biases,
            cache.k,
            cache.v,
            plan.write_slots,
            plan.write_positions,
        )
        sizes = (
            first.heads,
            first.kv_heads,
            first.head_dim,
            sum(first.gate_up.sizes) // 2,
            *self.native_sizes()[:2],
            INT4_GROUP,
            *self.native_sizes()[2:],
            # each layer's sliding window (0: full attention)
            [layer.window or 0 for layer in self.layers],
        )
        return loop(*weights, *sizes, *columns)
