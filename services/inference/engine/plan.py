"""The torch engine's forward plan: which path and kernel every part of a forward takes.

``resolve_plan`` decides once, when the engine is made, from the model (its architecture, dtype
and weights), the CPU (``services.common.platforms.cpu_features``) and the user-facing settings
(``TANDEM_INFERENCE_FORWARD``, ``QUANTIZE``, ``PROMPT_DTYPE``, ``NATIVE_DECODE``); the runner
builds exactly what the plan names and nothing else, so an engine's numbers never change paths
during its life. The plan is logged as one line at start-up (``forward plan: ...``) and served by
``/health`` and ``/v1/capabilities``. Benchmarks and tests that compare paths resolve a plan and
replace fields (``dataclasses.replace(plan, decode="python")``) before handing it to the engine.

Fields:

- ``decode``: decode tokens' forward. ``native-own`` (the lean forward's layer loop in C++ with
  its own operations between the int4 or oneDNN fp32 products, AVX2), ``python`` (the lean forward's Python
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
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from services.common.platforms import CpuFeatures, cpu_features
from services.inference.engine import native, packed_linear, quantized_linear
from services.inference.engine.layer_ops import describe
from services.inference.engine.native import NativeDecode
from services.inference.engine.quantized_linear import PromptDType, Quantize

if TYPE_CHECKING:
    from services.inference.engine.packed_linear import KernelChoice

Forward = Literal["auto", "reference"]
DecodePath = Literal["native-own", "python", "reference"]
PromptPath = Literal["native", "python", "reference"]
LEAN_DECODE: tuple[str, ...] = ("native-own", "python")
LEAN_PROMPT: tuple[str, ...] = ("native", "python")


@dataclass(frozen=True)
class PlanSettings:
    """The user-facing settings a plan is resolved from (``InferenceSettings`` has them too)."""

    forward: Forward = "auto"
    quantize: Quantize = "none"
    prompt_dtype: PromptDType = "auto"
    native_decode: NativeDecode = "off"


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
        return self.decode == "native-own" or self.prompt == "native" or self.head_decode == "q8_0"

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
    }
    return names.get(type(kernel), type(kernel).__name__)


def kernel_choice(plan: ForwardPlan, output_head: Any, batch_hint: int) -> KernelChoice | None:
    """The per-layer kernels ``plan`` names (None: every layer stays plain ``nn.Linear``)."""
    if plan.layer_decode == "torch" and plan.layer_prompt == "torch":
        return None
    if plan.quantize != "none" or plan.prompt_dtype == "bfloat16":
        return quantized_linear.layer_kernels(
            plan.quantize,
            output_head,
            batch_hint,
            plan.prompt_dtype,
            q8_head=plan.head_decode == "q8_0",
            int4_blocks="int4-q8" in plan.layer_decode.split("|"),
        )
    return packed_linear.packed_layers(batch_hint)


class _Probe:
    """What the lean forwards' checks read of a runner, for a model not yet served."""

    def __init__(
        self, model: Any, device: torch.device, quantize: Quantize, choose: KernelChoice | None
    ) -> None:
        from services.inference.engine.runner import base_model_of

        base = base_model_of(model)
        self.model = model
        self.config = base.config
        self.decoder = base.get_decoder()
        self.lm_head = base.get_output_embeddings()
        self.device = device
        self.dtype = next(base.parameters()).dtype
        self.quantize = quantize
        self.packed = packed_linear.PackedLinears(model, choose=choose) if choose is not None else None
        self._hooks: list[Any] = []


def _side_names(probe: _Probe, side: str) -> tuple[str, str]:
    """The decoder layers' kernel for ``side`` (one name, or each distinct one joined by ``|``) and
    the output head's."""
    kernels = {id(p.module): p.kernel for p in probe.packed.layers} if probe.packed is not None else {}
    layers = sorted(
        {
            kernel_name(kernels.get(id(m)), side, probe.dtype)
            for name, m in probe.decoder.named_modules()
            if type(m) is torch.nn.Linear and ".lora_" not in f".{name}"
        }
    )
    return "|".join(layers) or "torch", kernel_name(kernels.get(id(probe.lm_head)), side, probe.dtype)


def resolve_plan(
    model: Any,
    platform: CpuFeatures | None = None,
    settings: Any = None,
    *,
    device: Any = None,
) -> ForwardPlan:
    """The plan the engine runs ``model`` with (see the module doc). ``platform``: the CPU's
    features (None: this machine's); ``settings``: ``PlanSettings`` or anything with its
    attributes (``InferenceSettings``; None: ``PlanSettings()``). A setting that cannot run here
    raises ``ValueError`` naming it; with ``native_decode=on`` a failed C++ build raises
    ``native.NativeBuildError``."""
    from services.inference.engine import fused_decode, fused_prompt
    from services.inference.engine.runner import base_model_of

    settings = settings if settings is not None else PlanSettings()
    cpu = platform if platform is not None else cpu_features()
    forward: Forward = settings.forward
    base = base_model_of(model)
    param = next(base.parameters())
    device = torch.device(device) if device is not None else param.device
    dtype = param.dtype
    head_module = base.get_output_embeddings()
    reasons: dict[str, str] = {
        "forward": "TANDEM_INFERENCE_FORWARD=reference: the Hugging Face modules"
        if forward == "reference"
        else "the fastest path this model, CPU and torch build support",
    }

    quantize = quantized_linear.resolve(settings.quantize, model, head_module, device)
    if settings.quantize == "auto":
        reasons["quantize"] = (
            "auto: the weights hold 4-bit values already"
            if quantize == "int4"
            else "auto: weights kept as they are"
        )
    else:
        reasons["quantize"] = f"TANDEM_INFERENCE_QUANTIZE={settings.quantize}"
    prompt_dtype = quantized_linear.resolve_prompt_dtype(settings.prompt_dtype, quantize, dtype, cpu)
    if prompt_dtype == "bfloat16" and not packed_linear.available(device, torch.bfloat16):
        raise ValueError(f"prompt_dtype='bfloat16': this torch build has no oneDNN bf16 products on {device}")
    if quantize != "none" or prompt_dtype == "bfloat16":
        problem = quantized_linear.available(quantize, device)
        if problem is not None:
            raise ValueError(f"quantize={quantize!r}: {problem}")
    if dtype != torch.float32:
        reasons["prompt_dtype"] = f"the model's own dtype ({str(dtype).removeprefix('torch.')})"
    elif settings.prompt_dtype != "auto":
        reasons["prompt_dtype"] = f"TANDEM_INFERENCE_PROMPT_DTYPE={settings.prompt_dtype}"
    elif prompt_dtype == "bfloat16":
        reasons["prompt_dtype"] = f"{quantize} decode on a CPU with native bf16 (AVX512-BF16/AMX)"
    else:
        reasons["prompt_dtype"] = (
            "no native bf16 on this CPU" if quantize in ("int4", "int8") else "decode is not quantised"
        )

    # the C++ kernels: int4 or unquantised decode of an fp32 CPU model, never for the reference
    # forward
    built = False
    if forward == "reference":
        native_reason = "the reference forward runs no C++ kernels"
    elif not (quantize in ("int4", "none") and device.type == "cpu" and dtype == torch.float32):
        native_reason = f"decode is not int4 or unquantised on an fp32 CPU model ({quantize}, {dtype})"
    elif settings.native_decode == "off":
        native_reason = "TANDEM_INFERENCE_NATIVE_DECODE=off"
    elif not native.avx2():
        native_reason = "the C++ kernels need AVX2, which this CPU lacks"
    else:
        built = native.start(settings.native_decode)
        native_reason = "" if built else f"the C++ kernels were not built ({native.problem()})"

    # the output head's decode rows in Q8_0 blocks (needs the built module's q8_linear)
    q8 = built and native.q8_linear() is not None
    q8_head = quantize == "int4" and q8 and not cpu.amx_usable
    in_features = getattr(head_module, "in_features", 0)
    if quantize == "int4" and not q8:
        head_reason = native_reason or "the C++ kernels have no q8_linear"
    elif quantize == "int4" and cpu.amx_usable:
        head_reason = "bf16 head: this process may use the CPU's AMX (faster at every row count)"
    elif quantize == "int4" and in_features % quantized_linear.Q8_BLOCK:
        head_reason = f"{in_features} input features are not whole Q8_0 blocks"
    elif q8_head:
        head_reason = "q8_0 head: C++ kernels built (AVX2), no usable AMX"
    else:
        head_reason = f"quantize={quantize}: the head multiplies as the layers do"

    # the decoder layers' int4 decode products: Q4_1 x int8 rows (the built module's q4_linear:
    # AVX512-VNNI where the CPU has it, else AVX2, the same numbers), else torch's int4 kernel
    int4_blocks = quantize == "int4" and built and native.q4_linear() is not None
    linear_reason: str
    if quantize != "none" or prompt_dtype == "bfloat16":
        linear_reason = f"quantize={quantize}, prompt products in {prompt_dtype}"
        if quantize == "int4":
            linear_reason += (
                f", int4 decode as Q4_1 x int8 rows (C++, {'AVX512-VNNI' if cpu.avx512_vnni else 'AVX2'})"
                if int4_blocks
                else f", int4 decode in torch's kernel ({native_reason or 'the C++ module has no q4_linear'})"
            )
        packed = True
    elif forward == "reference":
        linear_reason = "the reference forward: torch's own nn.Linear"
        packed = False
    elif packed_linear.available(device, dtype):
        linear_reason = "oneDNN-prepacked weights (this torch build has them for the model's dtype)"
        packed = True
    else:
        linear_reason = f"no oneDNN packing for {dtype} on {device.type}: torch's own nn.Linear"
        packed = False
    draft = ForwardPlan(
        forward=forward,
        quantize=quantize,
        prompt_dtype=prompt_dtype,
        decode="reference",
        prompt="reference",
        layer_decode="torch" if not packed else "int4-q8" if int4_blocks else "?",
        layer_prompt="torch" if not packed else "?",
        head_decode="q8_0" if q8_head else "?",
        head_prompt="?",
        attention="?",
    )
    probe = _Probe(model, device, quantize, kernel_choice(draft, head_module, 16) if packed else None)
    layer_decode, head_decode = _side_names(probe, "decode")
    layer_prompt, head_prompt = _side_names(probe, "prompt")
    reasons["layers"] = linear_reason
    reasons["head"] = head_reason
    runner = cast(Any, probe)

    # the decoder layer's operations of the model's family (layer_ops.py), or why the lean forwards
    # cannot compute them
    ops = fused_decode.ops_of(runner)
    reasons["family"] = ops if isinstance(ops, str) else describe(ops)

    # decode tokens: the lean forward where its layer loop has the family's operations and the
    # layers decode in int4 or the model's own fp32/bf16 weights
    decode: DecodePath = "reference"
    if forward == "reference":
        reasons["decode"] = "the reference forward"
    elif (problem := fused_decode.unsupported(runner)) is not None:
        reasons["decode"] = f"the Hugging Face modules: {problem}"
    elif not built:
        decode = "python"
        reasons["decode"] = f"the lean forward's Python loop: {native_reason}"
    elif (own := fused_decode.own_unsupported(runner)) is None and native.decode_own() is not None:
        decode = "native-own"
        products = "int4" if quantize == "int4" else "oneDNN fp32"
        reasons["decode"] = f"the lean forward in C++ with its own operations (AVX2), {products} products"
    else:
        decode = "python"
        reasons["decode"] = f"the lean forward's Python loop: {own or 'the C++ loop is not built'}"

    # prompt chunks: the lean prompt forward where its layer loop has the family's operations (CPU)
    prompt: PromptPath = "reference"
    if forward == "reference":
        reasons["prompt"] = "the reference forward"
    elif (problem := fused_prompt.unsupported(runner)) is not None:
        reasons["prompt"] = f"the Hugging Face modules: {problem}"
    elif (
        built
        and layer_prompt == "onednn-bf16-blocks"
        and fused_decode.own_unsupported(runner) is None
        and native.prompt_own() is not None
    ):
        prompt = "native"
        reasons["prompt"] = "the lean prompt forward in C++ (bf16 block products, AVX2)"
    else:
        prompt = "python"
        if not built:
            why = native_reason
        elif layer_prompt != "onednn-bf16-blocks":
            why = "its C++ layers multiply in bf16 blocks; prompts here multiply in " + layer_prompt
        else:
            why = fused_decode.own_unsupported(runner) or "the C++ prompt layers are not built"
        reasons["prompt"] = f"the lean prompt forward's Python loop: {why}"

    prompt_attention = "invariant" if device.type == "cpu" else "sdpa"
    decode_attention = "own" if decode == "native-own" else prompt_attention
    attention = (
        decode_attention if decode_attention == prompt_attention else f"{decode_attention}/{prompt_attention}"
    )
    reasons["attention"] = (
        "ragged's batch-invariant attention" if device.type == "cpu" else "SDPA on an accelerator"
    ) + (", decode rows' in the C++ loop" if decode == "native-own" else "")
    return ForwardPlan(
        forward=forward,
        quantize=quantize,
        prompt_dtype=prompt_dtype,
        decode=decode,
        prompt=prompt,
        layer_decode=layer_decode,
        layer_prompt=layer_prompt,
        head_decode=head_decode,
        head_prompt=head_prompt,
        attention=attention,
        reasons=types.MappingProxyType(reasons),
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
    **paths: Any,
) -> ForwardPlan:
    """``resolve_plan`` for these settings, then ``paths`` (plan fields) replaced: how benchmarks and
    tests run one path against another (``plan_for(model, quantize="int4", decode="python")``)."""
    settings = PlanSettings(
        forward=forward, quantize=quantize, prompt_dtype=prompt_dtype, native_decode=native_decode
    )
    plan = resolve_plan(model, platform, settings, device=device)
    if not paths:
        return plan
    reasons = {**plan.reasons, **{name: "set by hand" for name in paths}}
    return dataclasses.replace(plan, **paths, reasons=types.MappingProxyType(reasons))


def plain_head() -> str:
    """The output head's decode kernel under int4 without the Q8_0 blocks: bf16 where oneDNN packs
    bf16 weights on this CPU, else the model's fp32."""
    return "onednn-bf16" if packed_linear.available(torch.device("cpu"), torch.bfloat16) else "onednn-fp32"
