"""The torch engine's forward plan: which path and kernel every part of a forward takes.

``resolve_plan`` decides when the engine is made, from the model (its architecture, dtype and
weights), the CPU (``services.common.platforms.cpu_features``) and the user-facing settings
(``TANDEM_INFERENCE_FORWARD``, ``QUANTIZE``, ``PROMPT_DTYPE``, ``NATIVE_DECODE``; ``PlanSettings``,
whose defaults are the server's); the runner builds exactly what the plan names and nothing else,
and no constructor decides a path. The capability checks it calls read the model's config, its
family's operations (``layer_ops``), its dtype and device (``ModelFacts``) and the plan's kernel
names, never a runner.

What a plan depends on can change while the engine runs: an adapter the lean forwards cannot
serve is loaded (or unloaded), or the model enters (or leaves) training mode. The runner then
resolves the plan again for the model's state (``in_state``: the built plan, its lean paths moved
to the Hugging Face modules or its C++ loops to the Python ones where the state asks), logs one
line naming what changed (``forward plan changed (...): decode python -> reference (why)``) and
runs the new plan; ``/health`` and ``/v1/capabilities`` serve the current one. The plan is logged
as one line at start-up (``forward plan: ...``). Benchmarks and tests that compare paths resolve a
plan and replace fields (``plan_for``, ``dataclasses.replace(plan, decode="python")``) before
handing it to the engine; a hand-made plan a model cannot run is refused by name (``refusal``).

Fields:

- ``decode``: decode tokens' forward. ``native-own`` (the lean forward's layer loop in C++ with
  its own operations between the int4 products of an fp32 model or the oneDNN products of an fp32
  or bf16 model's own weights, AVX2), ``python`` (the lean forward's Python
  loop, the bit-exact reference of the eager forward), ``reference`` (the Hugging Face modules).
- ``prompt``: prompt chunks' forward. ``native`` (the lean prompt forward's layers in C++),
  ``python`` (its Python loop), ``reference`` (the Hugging Face modules).
- ``layer_decode`` / ``layer_prompt``: the decoder layers' linear kernel for decode / prompt
  tokens; ``head_decode`` / ``head_prompt``: the output head's. Kernel names: ``torch`` (plain
  ``nn.Linear``), ``onednn-fp32`` / ``onednn-bf16`` (oneDNN-prepacked, the model's dtype or bf16),
  ``onednn-bf16-blocks`` (bf16 in fixed row blocks), ``int4`` (torch's int4 kernel, bf16 rows),
  ``int4-q8`` (Q4_1 groups times int8 rows, C++: AVX512-VNNI or AVX2), ``int8``, ``q8_0``.
- ``attention``: decode tokens' attention / prompt tokens' (one name where they agree):
  ``invariant`` (the batch-invariant attention of ``ragged.py``, CPU), ``sdpa`` (accelerators),
  ``own`` (the C++ loop's per-row attention).
- ``quantize``, ``prompt_dtype``: the resolved quantisation and prompt product dtype.
- ``kv_dtype``: the KV cache's dtype (``float32``, ``float16``, ``bfloat16``): the model's, or
  16 bits where ``TANDEM_INFERENCE_KV_DTYPE`` asks (llama.cpp's default cache type is f16). Decode
  reads every key and value of every running sequence each step, as many bytes as the weights at
  a few hundred tokens; 16 bits halve them. Products and softmax stay fp32 (a stored key or value
  is widened exactly); only the stored keys and values are rounded. Not the default: with int4
  weights and int8 prompt rows the default model's logits move by a few tenths under any such
  perturbation, which reorders its near-tied first answer tokens on some prompts.
- ``prompt_lookup``: ``ngram`` (draft tokens looked up in the sequence's own text, verified in the
  step's forward: ``prompt_lookup.py``, which the engine sets it with) or ``off``; plans that differ
  only there compare equal (the forward is the same).
- ``reasons``: a short reason for each field, and ``family``: the model type and its layer
  operations on the lean forwards (``layer_ops.py``), or why they cannot compute them.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from services.common.platforms import CpuFeatures, cpu_features
from services.inference.engine import (
    defaults,
    fused_decode,
    fused_prompt,
    native,
    packed_linear,
    quantized_linear,
)
from services.inference.engine.layer_ops import LayerOps, describe, layer_ops
from services.inference.engine.native import NativeDecode
from services.inference.engine.quantized_linear import Q8_HEADS, PromptDType, Q8Head, Quantize

if TYPE_CHECKING:
    from services.inference.engine.packed_linear import KernelChoice

Forward = Literal["auto", "reference"]
DecodePath = Literal["native-own", "python", "reference"]
PromptPath = Literal["native", "python", "reference"]
KVDType = Literal["model", "float16", "bfloat16"]
LEAN_DECODE: tuple[str, ...] = ("native-own", "python")
LEAN_PROMPT: tuple[str, ...] = ("native", "python")
# the prompt kernels the C++ prompt layers multiply with: bf16 blocks, or the decode blocks
# times int8 rows (prompt_dtype int8: the layers' one kernel)
BF16_BLOCKS = "onednn-bf16-blocks"
NATIVE_PROMPT_KERNELS = (BF16_BLOCKS, *fused_prompt.INT8_ROWS_NAMES)


@dataclass(frozen=True)
class PlanSettings:
    """The user-facing settings a plan is resolved from (``InferenceSettings`` has them too); the
    defaults are the server's (``defaults.py``, which its settings read too)."""

    forward: Forward = defaults.FORWARD
    quantize: Quantize = defaults.QUANTIZE
    prompt_dtype: PromptDType = defaults.PROMPT_DTYPE
    native_decode: NativeDecode = defaults.NATIVE_DECODE
    kv_dtype: KVDType = defaults.KV_DTYPE


@dataclass(frozen=True)
class ForwardPlan:
    forward: Forward
    quantize: Quantize
    prompt_dtype: PromptDType
    decode: DecodePath
    prompt: PromptPath
    layer_decode: str
    layer_prompt: str
    head_decode: str
    head_prompt: str
    attention: str
    kv_dtype: str = "float32"
    # the scheduler's, set by the engine (prompt_lookup.in_plan): not part of what a forward computes
    prompt_lookup: str = field(default="off", compare=False)
    reasons: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def lean_decode(self) -> bool:
        return self.decode in LEAN_DECODE

    @property
    def lean_prompt(self) -> bool:
        return self.prompt in LEAN_PROMPT

    @property
    def needs_native(self) -> bool:
        """Whether the plan runs any of the C++ kernels (``native.py``)."""
        return self.decode == "native-own" or self.prompt == "native" or self.head_decode in Q8_HEADS

    def paths(self) -> dict[str, str]:
        """Every field but the reasons."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "reasons"}

    def as_dict(self) -> dict[str, Any]:
        return {**self.paths(), "reasons": dict(self.reasons)}

    def line(self) -> str:
        """The plan as one log line."""
        paths = " ".join(f"{k}={v}" for k, v in self.paths().items())
        reasons = "; ".join(f"{k}: {v}" for k, v in self.reasons.items())
        return f"{paths} ({reasons})"


def kernel_name(kernel: Any, side: str, model_dtype: torch.dtype) -> str:
    """The plan's name of ``kernel``'s ``side`` (decode or prompt) kernel."""
    if isinstance(kernel, quantized_linear.ByTokenKind):
        kernel = getattr(kernel, side)
    if kernel is None:
        return "torch"
    if isinstance(kernel, quantized_linear.BlockedBF16):
        return "onednn-bf16-blocks"
    if isinstance(kernel, quantized_linear.BF16Packed):
        return "onednn-bf16"
    if isinstance(kernel, packed_linear.OneDNNPacked):
        return "onednn-" + {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(model_dtype, str(model_dtype))
    names = {
        quantized_linear.Int4WeightOnly: "int4",
        quantized_linear.Int4Blocks: "int4-q8",
        quantized_linear.Int8WeightOnly: "int8",
        quantized_linear.Q8Blocks: "q8_0",
        quantized_linear.Q8Rows: "q8_0-int8",
    }
    return names.get(type(kernel), type(kernel).__name__)


def _choice(
    quantize: Quantize,
    prompt_dtype: PromptDType,
    output_head: Any,
    batch_hint: int,
    *,
    q8_head: Q8Head,
    int4_blocks: bool,
    int8_blocks: bool = False,
) -> KernelChoice:
    """The per-layer kernels of a packed model: quantised or bf16-prompt kernels, else oneDNN's
    packed product in the model's dtype everywhere."""
    if quantize != "none" or prompt_dtype == "bfloat16":
        return quantized_linear.layer_kernels(
            quantize,
            output_head,
            batch_hint,
            prompt_dtype,
            q8_head=q8_head,
            int4_blocks=int4_blocks,
            int8_blocks=int8_blocks,
        )
    return packed_linear.packed_layers(batch_hint)


def kernel_choice(plan: ForwardPlan, output_head: Any, batch_hint: int) -> KernelChoice | None:
    """The per-layer kernels ``plan`` names (None: every layer stays plain ``nn.Linear``)."""
    if plan.layer_decode == "torch" and plan.layer_prompt == "torch":
        return None
    return _choice(
        plan.quantize,
        plan.prompt_dtype,
        output_head,
        batch_hint,
        q8_head="q8_0-int8"
        if plan.head_decode == "q8_0-int8"
        else "q8_0"
        if plan.head_decode == "q8_0"
        else None,
        int4_blocks="int4-q8" in plan.layer_decode.split("|"),
        int8_blocks=fused_decode.Q8_ROWS in plan.layer_decode.split("|"),
    )


def base_model_of(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@dataclass(frozen=True)
class ModelFacts:
    """What the capability checks read of a model: its config, its family's layer operations
    (``layer_ops``, or why the lean forwards cannot compute them), its dtype and its device."""

    config: Any
    ops: LayerOps | str
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, model: Any, device: Any = None) -> ModelFacts:
        """``model``'s facts (plain or PEFT); ``device``: where it runs (None: its weights')."""
        base = base_model_of(model)
        param = next(base.parameters())
        return cls(
            config=base.config,
            ops=layer_ops(base.config, base.get_decoder().layers),
            dtype=param.dtype,
            device=torch.device(device) if device is not None else param.device,
        )


@dataclass(frozen=True)
class _Native:
    """Whether the C++ kernels are built for this plan, and why not."""

    built: bool
    reason: str


@dataclass(frozen=True)
class _Kernels:
    """The decoder layers' and the output head's kernel names, decode and prompt side."""

    layer_decode: str
    layer_prompt: str
    head_decode: str
    head_prompt: str


def _quantisation(
    model: Any, head: Any, facts: ModelFacts, cpu: CpuFeatures, settings: Any, reasons: dict[str, str]
) -> Quantize:
    """The quantisation, with its reason; a setting that cannot run here raises ``ValueError``
    naming it."""
    quantize = quantized_linear.resolve(
        settings.quantize, model, head, facts.device, q8_rows=cpu.avx512_vnni and native.avx2()
    )
    if settings.quantize == "auto":
        reasons["quantize"] = {
            "int4": "auto: the weights hold 4-bit values already",
            "int8": "auto: the weights hold Q8_0 values already (AVX512-VNNI multiplies them as they are)",
        }.get(quantize, "auto: weights kept as they are")
    else:
        reasons["quantize"] = f"TANDEM_INFERENCE_QUANTIZE={settings.quantize}"
    problem = quantized_linear.available(quantize, facts.device)
    if problem is not None:
        raise ValueError(f"quantize={quantize!r}: {problem}")
    return quantize


def _prompt_dtype(
    quantize: Quantize,
    blocks: bool,
    facts: ModelFacts,
    cpu: CpuFeatures,
    settings: Any,
    reasons: dict[str, str],
) -> PromptDType:
    """The prompt products' dtype (``blocks``: the decode products are the own blocks times int8
    rows), with its reason; a setting that cannot run here raises ``ValueError`` naming it."""
    device, dtype = facts.device, facts.dtype
    prompt_dtype = quantized_linear.resolve_prompt_dtype(
        settings.prompt_dtype, quantize, dtype, cpu, blocks=blocks
    )
    if prompt_dtype == "bfloat16" and not packed_linear.available(device, torch.bfloat16):
        raise ValueError(f"prompt_dtype='bfloat16': this torch build has no oneDNN bf16 products on {device}")
    if prompt_dtype == "int8" and not blocks:
        raise ValueError(
            "prompt_dtype='int8': prompt rows take the decode kernel's int4/Q8_0 blocks times int8 rows, "
            f"which this plan does not multiply with (quantize={quantize}; they need the C++ kernels built, "
            "and AVX512-VNNI for int8)"
        )
    if dtype != torch.float32:
        reasons["prompt_dtype"] = f"the model's own dtype ({str(dtype).removeprefix('torch.')})"
    elif settings.prompt_dtype != "auto":
        reasons["prompt_dtype"] = f"TANDEM_INFERENCE_PROMPT_DTYPE={settings.prompt_dtype}"
    elif prompt_dtype == "int8":
        reasons["prompt_dtype"] = (
            f"{quantize} decode blocks times int8 rows for prompt rows too: oneDNN has no AMX here"
        )
    elif prompt_dtype == "bfloat16":
        reasons["prompt_dtype"] = (
            f"{quantize} decode on a CPU with native bf16 (AMX)"
            if cpu.amx_usable
            else f"{quantize} decode on a CPU with native bf16 (AVX512-BF16), no own int4/Q8_0 blocks"
        )
    else:
        reasons["prompt_dtype"] = (
            "no native bf16 on this CPU" if quantize in ("int4", "int8") else "decode is not quantised"
        )
    return prompt_dtype


def _native(forward: Forward, quantize: Quantize, facts: ModelFacts, setting: NativeDecode) -> _Native:
    """The C++ kernels: built for int4 decode of an fp32 CPU model or unquantised decode of an fp32
    or bf16 one, never for the reference forward (``native_decode=on``: a failed build raises
    ``native.NativeBuildError``)."""
    if forward == "reference":
        return _Native(False, "the reference forward runs no C++ kernels")
    own_dtypes = (torch.float32,) if quantize in ("int4", "int8") else (torch.float32, torch.bfloat16)
    if not (
        quantize in ("int4", "int8", "none") and facts.device.type == "cpu" and facts.dtype in own_dtypes
    ):
        return _Native(
            False,
            "decode is not int4/int8 of an fp32 CPU model or unquantised of an fp32/bf16 one "
            f"({quantize}, {facts.dtype})",
        )
    if setting == "off":
        return _Native(False, "TANDEM_INFERENCE_NATIVE_DECODE=off")
    if not native.avx2():
        return _Native(False, "the C++ kernels need AVX2, which this CPU lacks")
    built = native.start(setting)
    return _Native(built, "" if built else f"the C++ kernels were not built ({native.problem()})")


def _head(quantize: Quantize, built: _Native, cpu: CpuFeatures, head: Any) -> tuple[Q8Head, str]:
    """Whether the output head's decode rows multiply in Q8_0 blocks, which kernel, and why: times
    int8 rows (the built module's q8_rows) where the CPU has AVX512-VNNI, AMX or not (fewer bytes
    than the bf16 head, and at 16 rows as fast); times fp32 rows (q8_linear) on AVX2 alone, where no
    AMX can be usable."""
    if quantize != "int4":
        return None, f"quantize={quantize}: the head multiplies as the layers do"
    if getattr(head, "in_features", 0) % quantized_linear.Q8_BLOCK:
        return None, f"{getattr(head, 'in_features', 0)} input features are not whole Q8_0 blocks"
    if built.built and cpu.avx512_vnni and native.q8_rows() is not None:
        return "q8_0-int8", "q8_0 head times int8 rows: C++ kernels built, AVX512-VNNI"
    if not built.built or native.q8_linear() is None:
        return None, built.reason or "the C++ kernels have no q8_linear"
    if cpu.amx_usable:
        return None, "bf16 head: this process may use the CPU's AMX (faster than fp32 rows' Q8_0 at 16 rows)"
    return "q8_0", "q8_0 head: C++ kernels built (AVX2), no AVX512-VNNI"


def _own_blocks(quantize: Quantize, built: _Native, cpu: CpuFeatures) -> bool:
    """Whether the layers' decode products are the own blocks times int8 rows: int4 as Q4_1 groups
    (the built module's q4_linear, AVX512-VNNI where the CPU has it, else AVX2, the same numbers);
    int8 as Q8_0 blocks (q8_rows) where the CPU has AVX512-VNNI."""
    if quantize == "int4":
        return built.built and native.q4_linear() is not None
    return quantize == "int8" and built.built and cpu.avx512_vnni and native.q8_rows() is not None


def _layers(
    forward: Forward,
    quantize: Quantize,
    prompt_dtype: PromptDType,
    built: _Native,
    cpu: CpuFeatures,
    facts: ModelFacts,
) -> tuple[bool, bool, str]:
    """Whether the linear layers are packed (or quantised), whether their decode products are the
    own blocks times int8 rows (``_own_blocks``; else torch's int4 kernel or its per-channel int8),
    and why."""
    blocks = _own_blocks(quantize, built, cpu)
    if quantize != "none" or prompt_dtype == "bfloat16":
        reason = f"quantize={quantize}, prompt products in {prompt_dtype}"
        if quantize == "int4":
            reason += (
                f", int4 decode as Q4_1 x int8 rows (C++, {'AVX512-VNNI' if cpu.avx512_vnni else 'AVX2'})"
                if blocks
                else f", int4 decode in torch's kernel ({built.reason or 'the C++ module has no q4_linear'})"
            )
        if quantize == "int8":
            reason += (
                ", int8 decode as Q8_0 blocks x int8 rows (C++, AVX512-VNNI)"
                if blocks
                else f", int8 decode in torch's per-channel kernel ({built.reason or 'no AVX512-VNNI'})"
            )
        return True, blocks, reason
    if forward == "reference":
        return False, False, "the reference forward: torch's own nn.Linear"
    if packed_linear.available(facts.device, facts.dtype):
        return True, False, "oneDNN-prepacked weights (this torch build has them for the model's dtype)"
    return False, False, f"no oneDNN packing for {facts.dtype} on {facts.device.type}: torch's own nn.Linear"


def _kernel_names(model: Any, choose: KernelChoice | None, dtype: torch.dtype) -> _Kernels:
    """The kernel names ``choose`` gives the decoder layers (one name a side, or each distinct one
    joined by ``|``) and the output head: what a runner built from the plan multiplies with."""
    base = base_model_of(model)
    head = base.get_output_embeddings()
    kernels: dict[int, Any] = {}
    if choose is not None:
        # the layers a runner's ``PackedLinears`` tracks: plain linear layers, LoRA's own left out
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and ".lora_" not in f".{name}":
                kernels[id(module)] = choose(name, module)
    decoder = [
        m
        for name, m in base.get_decoder().named_modules()
        if type(m) is torch.nn.Linear and ".lora_" not in f".{name}"
    ]

    def layers(side: str) -> str:
        return "|".join(sorted({kernel_name(kernels.get(id(m)), side, dtype) for m in decoder})) or "torch"

    return _Kernels(
        layer_decode=layers("decode"),
        layer_prompt=layers("prompt"),
        head_decode=kernel_name(kernels.get(id(head)), "decode", dtype),
        head_prompt=kernel_name(kernels.get(id(head)), "prompt", dtype),
    )


def _decode_path(
    forward: Forward, facts: ModelFacts, quantize: Quantize, layer_decode: str, built: _Native
) -> tuple[DecodePath, str]:
    """Decode tokens' forward: the lean one where its layer loop has the family's operations and
    the layers decode in int4 or the model's own fp32/bf16 weights; its loop in C++ where the
    module is built and the model's sizes fit the loop."""
    if forward == "reference":
        return "reference", "the reference forward"
    problem = fused_decode.unsupported(facts.ops, facts.device, facts.dtype, quantize, layer_decode)
    if problem is not None:
        return "reference", f"the Hugging Face modules: {problem}"
    if not built.built:
        return "python", f"the lean forward's Python loop: {built.reason}"
    own = fused_decode.own_unsupported(facts.config, facts.dtype)
    if own is None and native.decode_own() is not None:
        products = {"int4": "int4", "int8": "Q8_0 x int8"}.get(
            quantize
        ) or f"oneDNN {str(facts.dtype).removeprefix('torch.')}"
        return "native-own", f"the lean forward in C++ with its own operations (AVX2), {products} products"
    return "python", f"the lean forward's Python loop: {own or 'the C++ loop is not built'}"


def _prompt_path(
    forward: Forward, facts: ModelFacts, layer_prompt: str, built: _Native
) -> tuple[PromptPath, str]:
    """Prompt chunks' forward: the lean one where its layer loop has the family's operations
    (CPU); its layers in C++ where they multiply in bf16 blocks or the decode blocks times int8
    rows and the module is built."""
    if forward == "reference":
        return "reference", "the reference forward"
    problem = fused_prompt.unsupported(facts.ops, facts.device, layer_prompt)
    if problem is not None:
        return "reference", f"the Hugging Face modules: {problem}"
    own = fused_decode.own_unsupported(facts.config, facts.dtype, prompt=True)
    if (
        built.built
        and layer_prompt in NATIVE_PROMPT_KERNELS
        and own is None
        and native.prompt_own() is not None
    ):
        products = "bf16 block" if layer_prompt == BF16_BLOCKS else f"{layer_prompt} (int8 rows)"
        return "native", f"the lean prompt forward in C++ ({products} products, AVX2)"
    if not built.built:
        why = built.reason
    elif layer_prompt not in NATIVE_PROMPT_KERNELS:
        why = (
            "its C++ layers multiply in bf16 blocks or int4/Q8_0 blocks times int8 rows; prompts here "
            "multiply in " + layer_prompt
        )
    else:
        why = own or "the C++ prompt layers are not built"
    return "python", f"the lean prompt forward's Python loop: {why}"


def _attention(decode: str, prompt: str) -> tuple[str, str]:
    """The attention field from decode tokens' and prompt tokens' attention (one name where they
    agree) and its reason."""
    attention = decode if decode == prompt else f"{decode}/{prompt}"
    parts = [
        "SDPA on an accelerator" if name == "sdpa" else "ragged's batch-invariant attention"
        for name in dict.fromkeys((decode, prompt))
        if name != "own"
    ]
    if decode == "own":
        parts.append("decode rows' in the C++ loop")
    if prompt == "own":
        parts.append("prompt rows' in the C++ loop (AVX-512: blocks of keys, an online softmax)")
    return attention, ", ".join(parts)


def _attentions(
    decode: DecodePath, prompt: PromptPath, device: torch.device, cpu: CpuFeatures
) -> tuple[str, str]:
    """Decode tokens' and prompt tokens' attention: the C++ loops' own where they run (the prompt
    layers' on a CPU with AVX-512, where torch runs its AVX512 kernels), else ragged's on a CPU,
    SDPA on an accelerator."""
    base = "invariant" if device.type == "cpu" else "sdpa"
    own_prompt = prompt == "native" and cpu.capability == "AVX512"
    return ("own" if decode == "native-own" else base), ("own" if own_prompt else base)


def resolve_plan(
    model: Any,
    platform: CpuFeatures | None = None,
    settings: Any = None,
    *,
    device: Any = None,
) -> ForwardPlan:
    """The plan the engine runs ``model`` with (see the module doc). ``platform``: the CPU's
    features (None: this machine's); ``settings``: ``PlanSettings`` or anything with its
    attributes (``InferenceSettings``; None: ``PlanSettings()``, the server's defaults). A setting
    that cannot run here raises ``ValueError`` naming it; with ``native_decode=on`` a failed C++
    build raises ``native.NativeBuildError``."""
    settings = settings if settings is not None else PlanSettings()
    cpu = platform if platform is not None else cpu_features()
    forward: Forward = settings.forward
    facts = ModelFacts.of(model, device)
    head = base_model_of(model).get_output_embeddings()
    reasons: dict[str, str] = {
        "forward": "TANDEM_INFERENCE_FORWARD=reference: the Hugging Face modules"
        if forward == "reference"
        else "the fastest path this model, CPU and torch build support",
    }
    quantize = _quantisation(model, head, facts, cpu, settings, reasons)
    built = _native(forward, quantize, facts, settings.native_decode)
    prompt_dtype = _prompt_dtype(quantize, _own_blocks(quantize, built, cpu), facts, cpu, settings, reasons)
    q8_head, head_reason = _head(quantize, built, cpu, head)
    packed, own_blocks, reasons["layers"] = _layers(forward, quantize, prompt_dtype, built, cpu, facts)
    reasons["head"] = head_reason
    choose = (
        _choice(
            quantize,
            prompt_dtype,
            head,
            16,
            q8_head=q8_head,
            int4_blocks=own_blocks and quantize == "int4",
            int8_blocks=own_blocks and quantize == "int8",
        )
        if packed
        else None
    )
    kernels = _kernel_names(model, choose, facts.dtype)
    reasons["family"] = facts.ops if isinstance(facts.ops, str) else describe(facts.ops)
    decode, reasons["decode"] = _decode_path(forward, facts, quantize, kernels.layer_decode, built)
    prompt, reasons["prompt"] = _prompt_path(forward, facts, kernels.layer_prompt, built)
    attention, reasons["attention"] = _attention(*_attentions(decode, prompt, facts.device, cpu))
    kv_dtype, reasons["kv_dtype"] = _kv_dtype(settings.kv_dtype, facts)
    return ForwardPlan(
        forward=forward,
        quantize=quantize,
        prompt_dtype=prompt_dtype,
        decode=decode,
        prompt=prompt,
        layer_decode=kernels.layer_decode,
        layer_prompt=kernels.layer_prompt,
        head_decode=kernels.head_decode,
        head_prompt=kernels.head_prompt,
        attention=attention,
        kv_dtype=kv_dtype,
        reasons=types.MappingProxyType(reasons),
    )


def _kv_dtype(setting: KVDType, facts: ModelFacts) -> tuple[str, str]:
    """The KV cache's dtype and its reason; a 16-bit cache asked for where it cannot be raises
    ``ValueError`` naming the setting."""
    model = str(facts.dtype).removeprefix("torch.")
    if setting == "model" or setting == model:
        return model, "the model's dtype"
    if facts.device.type != "cpu" or facts.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"kv_dtype={setting!r}: a 16-bit KV cache is the CPU engine's for fp32 or bf16 models, "
            f"not a {model} model on {facts.device}"
        )
    return setting, f"TANDEM_INFERENCE_KV_DTYPE={setting}: half the bytes a decode step reads"


def refusal(plan: ForwardPlan, facts: ModelFacts) -> str | None:
    """Why a runner cannot run ``plan`` on a model of ``facts`` (a plan made by hand: a resolved
    plan never names a path its checks refuse), naming the field; None: it can. The C++ paths
    are checked after ``native.start``."""
    if plan.lean_decode:
        problem = fused_decode.unsupported(
            facts.ops, facts.device, facts.dtype, plan.quantize, plan.layer_decode
        )
        if problem is None and plan.decode == "native-own":
            problem = fused_decode.own_unsupported(facts.config, facts.dtype)
        if problem is not None:
            return f"decode={plan.decode!r}: {problem}"
    if plan.lean_prompt:
        problem = fused_prompt.unsupported(facts.ops, facts.device, plan.layer_prompt)
        if problem is None and plan.prompt == "native":
            if plan.layer_prompt not in NATIVE_PROMPT_KERNELS:
                problem = (
                    "the C++ prompt layers multiply in bf16 blocks or int4/Q8_0 blocks times int8 rows, "
                    f"not {plan.layer_prompt}"
                )
            else:
                problem = fused_decode.own_unsupported(facts.config, facts.dtype, prompt=True)
            if problem is None and native.prompt_own() is None:
                problem = "the C++ prompt layers are not built"
        if problem is not None:
            return f"prompt={plan.prompt!r}: {problem}"
    if plan.prompt == "native" and attentions(plan)[1] == "own" and cpu_features().capability != "AVX512":
        return f"attention={plan.attention!r}: the C++ prompt layers' own attention needs AVX-512"
    return None


def in_state(plan: ForwardPlan, *, lora_problem: str | None, training: bool) -> ForwardPlan:
    """``plan`` (what a runner built) resolved again for the model as it is now: with adapters the
    lean forwards cannot serve (``lora_problem``, ``fused_decode.lora_unsupported``) its tokens
    take the Hugging Face modules; in training mode (LoRA dropout is the Python loops') the C++
    loops give way to the Python ones. ``plan`` itself when neither applies, so a runner whose
    adapters are unloaded or whose model left training mode runs the plan it was built for."""
    decode, prompt = plan.decode, plan.prompt
    reasons = dict(plan.reasons)
    if lora_problem is not None:
        if plan.lean_decode:
            decode, reasons["decode"] = "reference", f"the Hugging Face modules: {lora_problem}"
        if plan.lean_prompt:
            prompt, reasons["prompt"] = "reference", f"the Hugging Face modules: {lora_problem}"
    elif training:
        why = "the model is in training mode (LoRA dropout is the Python loop's)"
        if decode == "native-own":
            decode, reasons["decode"] = "python", f"the lean forward's Python loop: {why}"
        if prompt == "native":
            prompt, reasons["prompt"] = "python", f"the lean prompt forward's Python loop: {why}"
    if (decode, prompt) == (plan.decode, plan.prompt):
        return plan
    attention, reasons["attention"] = _moved_attention(plan, decode, prompt)
    return dataclasses.replace(
        plan, decode=decode, prompt=prompt, attention=attention, reasons=types.MappingProxyType(reasons)
    )


def _moved_attention(plan: ForwardPlan, decode: str, prompt: str) -> tuple[str, str]:
    """``plan``'s attention field and reason once its loops are ``decode`` and ``prompt``: a loop
    that left C++ takes the attention of the forward it moved to."""
    base = "sdpa" if "sdpa" in plan.attention else "invariant"
    decode_attention, prompt_attention = attentions(plan)
    return _attention(
        decode_attention if decode == "native-own" else base,
        prompt_attention if prompt == "native" else base,
    )


def attentions(plan: ForwardPlan) -> tuple[str, str]:
    """Decode tokens' and prompt tokens' attention in ``plan``."""
    parts = plan.attention.split("/")
    return parts[0], parts[-1]


def changes(before: ForwardPlan, after: ForwardPlan) -> str:
    """What differs between two plans, one clause a field: ``decode python -> reference (why)``."""
    old, new = before.paths(), after.paths()
    return "; ".join(
        f"{name} {old[name]} -> {value} ({after.reasons.get(name, '')})"
        for name, value in new.items()
        if old[name] != value
    )


def plan_for(
    model: Any,
    *,
    device: Any = None,
    platform: CpuFeatures | None = None,
    forward: Forward = "auto",
    quantize: Quantize = "none",
    prompt_dtype: PromptDType = "auto",
    native_decode: NativeDecode = "off",
    kv_dtype: KVDType = "model",
    **paths: Any,
) -> ForwardPlan:
    """``resolve_plan`` for these settings, then ``paths`` (plan fields) replaced: how benchmarks and
    tests run one path against another (``plan_for(model, quantize="int4", decode="python")``).
    Its settings start from the bit-exact baseline (the model's own weights, no C++ kernels), not
    the server's defaults (``PlanSettings()``), so a comparison names each path it turns on."""
    settings = PlanSettings(
        forward=forward,
        quantize=quantize,
        prompt_dtype=prompt_dtype,
        native_decode=native_decode,
        kv_dtype=kv_dtype,
    )
    plan = resolve_plan(model, platform, settings, device=device)
    if not paths:
        return plan
    reasons = {**plan.reasons, **{name: "set by hand" for name in paths}}
    chosen = dataclasses.replace(plan, **paths, reasons=types.MappingProxyType(reasons))
    if "attention" in paths:
        return chosen
    attention, reasons["attention"] = _moved_attention(plan, chosen.decode, chosen.prompt)
    return dataclasses.replace(chosen, attention=attention, reasons=types.MappingProxyType(reasons))


def plain_head() -> str:
    """The output head's decode kernel under int4 without the Q8_0 blocks: bf16 where oneDNN packs
    bf16 weights on this CPU, else the model's fp32."""
    return "onednn-bf16" if packed_linear.available(torch.device("cpu"), torch.bfloat16) else "onednn-fp32"
