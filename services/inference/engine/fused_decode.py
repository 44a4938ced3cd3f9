"""The decode tokens of a Llama-family model through one lean forward (int4 decode, the default).

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
modules of a decoder layer, a model whose adapters are not routed per row (the trainer's
in-process engine uses its model's active adapter), or a layer whose decode kernel is not
int4 make ``unsupported`` name the reason, and decode steps run the eager forward.

The loop over the layers runs in C++ where the native module is built (``native.py``, AVX2
CPUs; the default), with its own operations between the int4 products (``decode_own``), which
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
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from services.inference.engine import native, ragged
from services.inference.engine.kv_cache import SlabKVCache
from services.inference.engine.lora_rows import LoraRows
from services.inference.engine.packed_linear import RowKernel
from services.inference.engine.prefix_cache import tensors_state
from services.inference.engine.quantized_linear import INT4_GROUP, ByTokenKind, Int4Blocks, Int4WeightOnly

if TYPE_CHECKING:
    from services.inference.engine.runner import ModelRunner

# model types whose decoder layers are Llama's (RMSNorm, RoPE, GQA attention, SiLU-gated MLP)
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2"})
ATTENTION = ("q_proj", "k_proj", "v_proj")
MLP_IN = ("gate_proj", "up_proj")
PROJECTIONS = (*ATTENTION, "o_proj", *MLP_IN, "down_proj")
_INT4 = Int4WeightOnly()
# ragged's attention of one kind of token: (plan, queries [T, H, d], key slab, value slab, scaling)
Attention = Callable[
    [ragged.RaggedPlan, torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor
]


def _base(module: Any) -> torch.nn.Linear:
    """The plain linear layer under a PEFT LoRA wrapper (or the layer itself)."""
    return getattr(module, "base_layer", module)


def _projection(layer: Any, name: str) -> Any:
    """A decoder layer's projection ``name`` (its attention's or its MLP's), or None."""
    return getattr(layer.self_attn if name in (*ATTENTION, "o_proj") else layer.mlp, name, None)


def _lora(module: Any) -> Any | None:
    """The PEFT LoRA layer wrapping a projection, if any."""
    return module if hasattr(module, "lora_A") and hasattr(module, "base_layer") else None


class _SideBySide:
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
        self.modules = [_projection(layer, name) for name in self.names]
        self.linears = [_base(m) for m in self.modules]
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

    def add(self, product: _SideBySide, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the deltas of ``x`` ``[n, in]`` to ``out`` ``[n, product's columns]``."""
        ...


class ModuleDeltas:
    """Each LoRA module's deltas added to its slice of the product as PEFT's mixed batch adds them
    (``LoraRows.add``): the eager forward's numbers."""

    def __init__(self, rows: LoraRows) -> None:
        self.rows = rows

    def add(self, product: _SideBySide, x: torch.Tensor, out: torch.Tensor) -> None:
        start = 0
        for module, size in zip(product.modules, product.sizes, strict=True):
            layer = _lora(module)
            if layer is not None:
                self.rows.add(layer, x, out[:, start : start + size])
            start += size


@dataclass
class _Layer:
    module: Any
    qkv: _SideBySide
    o: _SideBySide
    gate_up: _SideBySide
    down: _SideBySide
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float

    def products(self) -> tuple[_SideBySide, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


def run_layers(
    layers: list[_Layer],
    plan: ragged.RaggedPlan,
    attention: Attention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    lora: ProductDeltas | None,
    cache: SlabKVCache,
) -> torch.Tensor:
    """The decoder layers on the residual stream ``x`` ``[T, hidden]`` (the lean forwards' Python
    loop): ``attention`` is ``ragged``'s for the plan's kind of token, ``cos``/``sin``
    ``rope_tables``'."""
    tokens = x.shape[0]
    half = sin.shape[-1] // 2
    for index, layer in enumerate(layers):
        module = layer.module
        kernel = layer.qkv.kernel
        residual = x
        h = _rms_norm(module.input_layernorm, x)
        # the products kept as the kernel gives them (bf16) where nothing is added to them: the
        # fp32 operations they meet widen them exactly, as the cast to fp32 would
        qkv = layer.qkv(h, kernel.rows(h), lora, keep=True)
        nq, nk = layer.heads * layer.head_dim, layer.kv_heads * layer.head_dim
        # RoPE on the query and key heads together (elementwise: each head's values as alone)
        qk = qkv[:, : nq + nk].view(tokens, layer.heads + layer.kv_heads, layer.head_dim)
        qk = (qk * cos) + (torch.roll(qk, half, -1) * sin)
        q, k = qk[:, : layer.heads], qk[:, layer.heads :]
        v = qkv[:, nq + nk :].view(tokens, layer.kv_heads, layer.head_dim).to(x.dtype)
        k_slab, v_slab = cache.update(k.unsqueeze(2), v.unsqueeze(2), index)
        attn = attention(plan, q, k_slab, v_slab, layer.scaling).reshape(tokens, nq)
        x = residual + layer.o(attn, kernel.rows(attn), lora, keep=True)
        residual = x
        h = _rms_norm(module.post_attention_layernorm, x)
        gate_up = layer.gate_up(h, kernel.rows(h), lora, keep=True)
        size = layer.gate_up.sizes[0]
        act = F.silu(gate_up[:, :size].to(x.dtype)) * gate_up[:, size:]
        x = residual + layer.down(act, kernel.rows(act), lora, keep=True)
    return x


def rope_tables(decoder: Any, x: torch.Tensor, plan: ragged.RaggedPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin ``[T, 1, d]`` at the plan's positions, sin with its first half negated:
    rotate_half(x) * sin is then roll(x, d/2) * sin, the same products (a negation is exact) in two
    operations a layer instead of five."""
    cos, sin = decoder.rotary_emb(x, plan.positions)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    # one fused kernel, the same values as LlamaRMSNorm's five operations on fp32 rows (checked
    # bit for bit by the tests against the eager forward)
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


def llama_problem(runner: ModelRunner) -> str | None:
    """Why this runner's decoder layers are not Llama's as the lean forwards compute them (None:
    they are)."""
    config = runner.config
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        return f"model type {model_type!r} is not one of {sorted(LLAMA_FAMILY)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    for layer in runner.decoder.layers:
        if getattr(layer.self_attn, "q_norm", None) is not None or not hasattr(
            layer, "post_attention_layernorm"
        ):
            return "the decoder layers are not Llama's"
        for name in PROJECTIONS:
            if _projection(layer, name) is None:
                return f"a decoder layer has no {name}"
    return None


def layer_kernels(runner: ModelRunner) -> dict[int, Any]:
    """The kernel each base linear layer of the runner's products has, by module id."""
    return {id(p.module): p.kernel for p in runner.packed.layers} if runner.packed is not None else {}


def decode_kernel(runner: ModelRunner) -> Int4WeightOnly:
    """The int4 kernel of the side-by-side decode products: ``Int4Blocks`` where the plan gave it
    to every projection, else torch's (``Int4WeightOnly``)."""
    kernels = layer_kernels(runner)
    decodes = {
        type(getattr(kernels.get(id(_base(_projection(layer, name)))), "decode", None))
        for layer in runner.decoder.layers
        for name in PROJECTIONS
    }
    return Int4Blocks() if decodes == {Int4Blocks} else _INT4


def unsupported(runner: ModelRunner) -> str | None:
    """Why this runner's decode tokens cannot take the lean forward (None: they can)."""
    problem = llama_problem(runner)
    if problem is not None:
        return problem
    if runner.quantize != "int4" or runner.device.type != "cpu" or runner.dtype != torch.float32:
        return "decode is not int4 on an fp32 CPU model"
    kernels = layer_kernels(runner)
    for layer in runner.decoder.layers:
        for name in PROJECTIONS:
            kernel = kernels.get(id(_base(_projection(layer, name))))
            if not (isinstance(kernel, ByTokenKind) and isinstance(kernel.decode, Int4WeightOnly)):
                return f"{name} does not decode in int4"
    return None


def lora_unsupported(runner: ModelRunner) -> str | None:
    """Why the adapters loaded now keep decode steps on the eager forward (None: they don't)."""
    projections = {id(_projection(layer, n)) for layer in runner.decoder.layers for n in PROJECTIONS}
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return None
    decoder_layers = set(map(id, runner.decoder.layers.modules()))
    for name, module in runner.model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not runner._hooks:
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


def own_unsupported(runner: ModelRunner) -> str | None:
    """Why the C++ loop's own operations (``decode_own``) do not fit this model (None: they do)."""
    config = runner.config
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
    return None


def native_args(layers: list[_Layer]) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The layers' weights as the C++ loops take them: each layer's two norm weights, and each
    product's prepared weight in its two parts (int4: packed and scales; bf16 blocks: packed and
    block rows) and its bias."""
    norms, first, second, biases = [], [], [], []
    for layer in layers:
        norms += [layer.module.input_layernorm.weight, layer.module.post_attention_layernorm.weight]
        for product in layer.products():
            (a, b), bias = product.prepared, product.bias
            first.append(a)
            second.append(b)
            biases.append(bias)
    return norms, first, second, biases


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
                        lora = _lora(module)
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

    def __init__(self, runner: ModelRunner, kernel: RowKernel) -> None:
        self.runner = runner
        self.decoder = runner.decoder
        config = runner.config
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.layers = [
            _Layer(
                module=layer,
                qkv=_SideBySide(layer, ATTENTION, kernel),
                o=_SideBySide(layer, ("o_proj",), kernel),
                gate_up=_SideBySide(layer, MLP_IN, kernel),
                down=_SideBySide(layer, ("down_proj",), kernel),
                heads=heads,
                kv_heads=kv_heads,
                head_dim=head_dim,
                scaling=float(layer.self_attn.scaling),
            )
            for layer in self.decoder.layers
        ]
        self.lora_problem: str | None = None
        self._multiplied: frozenset[int] | None = None
        # the state of every weight the products were prepared from (``_fresh``), and the C++
        # loops' arguments made from them
        self._fingerprint: tuple[int, int] | None = None
        self._native_args: tuple[list[Any], ...] | None = None
        self._native_lora = NativeLora(self.layers)

    def refresh(self) -> None:
        """Re-read the projections after an adapter was loaded or unloaded (PEFT wraps and
        unwraps them) and whether the adapters loaded now can take this forward."""
        for fused in self.layers:
            for product in fused.products():
                product.use(fused.module)
        self.lora_problem = lora_unsupported(self.runner)
        self._multiplied = None
        self._fingerprint = None
        self._native_lora = NativeLora(self.layers)

    def _fresh(self) -> None:
        """Every product prepared from its weights as they are now: one pass over the weights a
        forward (an update in place by the trainer's in-process engine shows), not one check a
        product."""
        fingerprint = tensors_state(
            [lin.weight for layer in self.layers for p in layer.products() for lin in p.linears]
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
        """``native_args`` of the layers, made again after a weight changed (``_fresh``)."""
        if self._native_args is None:
            self._native_args = native_args(self.layers)
        return self._native_args


class FusedDecode(LeanLayers):
    """Decode tokens through the lean forward (see the module doc)."""

    def __init__(self, runner: ModelRunner, *, native: bool = False) -> None:
        super().__init__(runner, decode_kernel(runner))
        # the layers' loop in C++ (``decode_own``) once ``native.start`` has built it and the
        # model's sizes fit it, else in Python
        self.native = native and own_unsupported(runner) is None

    def __call__(self, plan: ragged.RaggedPlan, lora: LoraRows | None = None) -> torch.Tensor:
        """Logits ``[D, V]`` of a plan of decode tokens only, inside ``ragged.active(plan)``,
        the runner's adapter routing and its packed products (for the embeddings and head);
        ``lora``: the forward's rows by adapter (what the runner's routing yields)."""
        runner = self.runner
        cache = runner.cache
        ids = plan.input_ids.view(-1)
        self._fresh()
        x = self.decoder.embed_tokens(ids)
        cos, sin = rope_tables(self.decoder, x, plan)
        loop = native.decode_own() if self.native and not self.decoder.training else None
        if loop is not None:
            x = self._native(loop, plan, x, cos, sin, lora)
            return runner.lm_head(self.decoder.norm(x))
        deltas = None if lora is None else ModuleDeltas(lora)
        x = run_layers(self.layers, plan, ragged.decode_attention, x, cos, sin, deltas, cache)
        return runner.lm_head(self.decoder.norm(x))

    def _native(
        self,
        loop: Any,
        plan: ragged.RaggedPlan,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoraRows | None,
    ) -> torch.Tensor:
        """The layers' loop in C++ (``native.decode_own``): its own operations between the products;
        each token attends its own slab row up to its position (no plan-wide bias or view)."""
        norms, packed, scales, biases = self.native_args()
        columns = self._native_lora.columns(lora)
        first = self.layers[0]
        cache = self.runner.cache
        weights = (
            x,
            cos,
            sin,
            norms,
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
            first.gate_up.sizes[0],
            float(first.module.input_layernorm.variance_epsilon),
            first.scaling,
            INT4_GROUP,
        )
        return loop(*weights, *sizes, *columns)
