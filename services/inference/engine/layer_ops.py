"""What a model family's decoder layer does, as variants of the lean forwards' one layer loop.

The families people run are Llama's decoder layer with a few operations changed, never a
different loop: where the norms sit and whether their weight counts from 1, the MLP's
activation, norms on the query and key heads, constant multipliers on the embeddings, the
residual branches, the attention scores and the logits, and which RoPE table a layer takes
(none, a partial one, one of two bases) and its attention window (full attention, or only the
last ``window`` positions: Gemma 3's local layers, Mistral v0.1, Qwen2 with ``use_sliding_window``).
``layer_ops`` reads those from the model's config and
modules once; the Python loop (``fused_decode.run_layers``) and the C++ loop
(``csrc/decode_layers.cpp``) run the same steps with them.

| family (``model_type``) | what differs from Llama |
|---|---|
| ``llama`` (Llama 3.x, SmolLM2), ``mistral``, ``qwen2`` | nothing (Llama 3's RoPE scaling and Qwen2's q/k/v biases are in the RoPE tables and the products; Mistral v0.1's and Qwen2's sliding windows are the layers' windows) |
| ``qwen3`` | RMSNorm on each query and key head before RoPE |
| ``gemma3_text`` | sandwich norms (after attention and after the MLP too), norm weights counting from 1, GELU (tanh), q/k norms, per-layer RoPE bases (local and global), a sliding window on its local layers; its scaled embeddings are its embedding module's |
| ``granite`` | embedding, residual, attention and logits multipliers |
| ``granitemoehybrid`` (Granite 4.0 dense: every layer attention, no experts) | Granite's multipliers; gate/up as one fused projection (``shared_mlp.input_linear``, then ``output_linear``); no RoPE where ``position_embedding_type`` is not ``rope`` |
| ``smollm3`` | layers without RoPE |
| ``phi3`` (Phi-3, Phi-4-mini) | q/k/v and gate/up as single fused projections, partial RoPE |

A family outside the table, or one of these with an operation the loop does not have (attention
score soft-capping, another activation, Granite 4.0's Mamba layers or experts), keeps the Hugging
Face modules, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# activations the loop computes, by the configs' names
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "granite",
    "granitemoehybrid",
    "smollm3",
    "phi3",
)
# the RoPE table of a layer that takes the model's one table
DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class LayerOps:
    """One family's variants of the layer loop's operations (see the module doc)."""

    model_type: str
    # the projections multiplied side by side: q/k/v (Phi's one qkv_proj, else three) and the
    # MLP's gate/up (Phi's gate_up_proj), each in the order their outputs are split
    attention: tuple[str, ...]
    mlp_in: tuple[str, ...]
    mlp_out: str  # the MLP's down projection (Granite 4.0's output_linear)
    activation: str  # "silu" or "gelu_tanh"
    norm_offset: float  # Gemma's RMSNorm multiplies by 1 + weight
    sandwich: bool  # norms on the attention's and the MLP's outputs too (Gemma 3)
    qk_norm: bool  # RMSNorm on every query and key head before RoPE (Qwen3, Gemma 3)
    embedding_multiplier: float
    residual_multiplier: float
    logits_divisor: float
    logits_softcap: float | None
    rope: tuple[str | None, ...]  # per layer, the RoPE table it takes (None: no RoPE)
    # per layer, its sliding attention window (a query attends keys at positions > its own -
    # window, as transformers' sliding-window mask), None for full attention
    window: tuple[int | None, ...] = ()

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(w is not None for w in self.window)

    @property
    def projections(self) -> tuple[str, ...]:
        return (*self.attention, "o_proj", *self.mlp_in, self.mlp_out)

    @property
    def llama(self) -> bool:
        """Whether every operation is Llama's (the C++ prompt layers' and the eager forward's
        bit-exact reference path before these variants)."""
        return (
            self.activation == "silu"
            and not self.norm_offset
            and not self.sandwich
            and not self.qk_norm
            and self.embedding_multiplier == 1.0
            and self.residual_multiplier == 1.0
            and all(r == DEFAULT_ROPE for r in self.rope)
        )

    def norm_names(self) -> tuple[str, str | None, str, str | None]:
        """A layer's norms: before attention, on its output (sandwich), before the MLP, on its
        output (sandwich)."""
        if self.sandwich:
            return (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        return ("input_layernorm", None, "post_attention_layernorm", None)


def _number(config: Any, name: str, default: float) -> float:
    value = getattr(config, name, None)
    return float(value) if value is not None else default


def layer_ops(config: Any, layers: Any) -> LayerOps | str:
    """The operations of ``layers`` (the decoder's) for a model of ``config``, or why the loop
    cannot compute them."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return f"model type {model_type!r} is not one of {sorted(FAMILIES)}"
    act_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    activation = ACTIVATIONS.get(str(act_name))
    if activation is None:
        return f"activation {act_name!r} is not one of {sorted(ACTIVATIONS)}"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention scores are soft-capped (attn_logit_softcapping)"
    granite4 = model_type == "granitemoehybrid"
    if granite4:
        kinds = list(getattr(config, "layers_block_type", None) or [])
        mamba = [i for i, kind in enumerate(kinds) if kind != "full_attention"]
        if mamba:
            return f"Granite 4.0 hybrid: {len(mamba)} of {len(kinds)} layers are Mamba layers, not attention"
        if int(getattr(config, "num_local_experts", 0) or 0) > 0:
            return f"Granite 4.0 with {config.num_local_experts} experts (mixture of experts)"
    fused = model_type == "phi3"
    sandwich = model_type == "gemma3_text"
    rope: list[str | None] = []
    windows: list[int | None] = []
    layer_types = getattr(config, "layer_types", None)
    no_rope = getattr(config, "no_rope_layers", None)
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        if model_type == "gemma3_text":
            if not layer_types:
                return "a Gemma 3 config without layer_types"
            rope.append(str(layer_types[index]))
        elif model_type == "smollm3":
            rope.append(DEFAULT_ROPE if no_rope is None or no_rope[index] else None)
        elif granite4:
            rope.append(DEFAULT_ROPE if getattr(config, "position_embedding_type", None) == "rope" else None)
        else:
            rope.append(DEFAULT_ROPE)
        windows.append(layer_window(config, attn))
        if (getattr(attn, "q_norm", None) is None) != (model_type not in ("qwen3", "gemma3_text")):
            return "the decoder layers' q/k norms are not their family's"
    ops = LayerOps(
        model_type=model_type,
        attention=("qkv_proj",) if fused else ("q_proj", "k_proj", "v_proj"),
        mlp_in=("gate_up_proj",) if fused else ("input_linear",) if granite4 else ("gate_proj", "up_proj"),
        mlp_out="output_linear" if granite4 else "down_proj",
        activation=activation,
        norm_offset=1.0 if model_type == "gemma3_text" else 0.0,
        sandwich=sandwich,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        embedding_multiplier=_number(config, "embedding_multiplier", 1.0),
        residual_multiplier=_number(config, "residual_multiplier", 1.0),
        logits_divisor=_number(config, "logits_scaling", 1.0),
        logits_softcap=getattr(config, "final_logit_softcapping", None),
        rope=tuple(rope),
        window=tuple(windows),
    )
    for layer in layers:
        for name in ops.norm_names():
            if name is not None and getattr(layer, name, None) is None:
                return f"a decoder layer has no {name}"
        for name in ops.projections:
            if projection(layer, name) is None:
                return f"a decoder layer has no {name}"
    return ops


def describe(ops: LayerOps) -> str:
    """The family's operations in a few words (the forward plan's reason)."""
    parts = []
    if len(ops.attention) == 1:
        parts.append("fused q/k/v and gate/up")
    elif len(ops.mlp_in) == 1:
        parts.append("fused gate/up")
    if ops.qk_norm:
        parts.append("q/k norms")
    if ops.sandwich:
        parts.append("sandwich norms")
    if ops.norm_offset:
        parts.append("norm weights from 1")
    if ops.activation != "silu":
        parts.append(ops.activation.replace("_", "-"))
    if ops.embedding_multiplier != 1.0 or ops.residual_multiplier != 1.0 or ops.logits_divisor != 1.0:
        parts.append("multipliers")
    if ops.logits_softcap is not None:
        parts.append("soft-capped logits")
    if None in ops.rope:
        parts.append(f"{ops.rope.count(None)} layers without RoPE")
    if len(set(ops.rope) - {None}) > 1:
        parts.append("a RoPE base per layer type")
    windowed = [w for w in ops.window if w is not None]
    if windowed:
        parts.append(f"a sliding window of {max(windowed)} on {len(windowed)} of {len(ops.window)} layers")
    return f"{ops.model_type}: Llama's layer" + (" with " + ", ".join(parts) if parts else "")


def layer_window(config: Any, attn: Any) -> int | None:
    """The sliding window of a decoder layer's attention module, as it hands it to its attention
    function: Gemma 3's, Qwen2/3's and SmolLM3's modules hold it (None on full-attention layers),
    Mistral's and Phi-3's read their config's (every layer)."""
    window = (
        attn.sliding_window
        if hasattr(attn, "sliding_window")
        else getattr(config, "sliding_window", None)
        if getattr(config, "model_type", None) in ("mistral", "phi3")
        else None
    )
    return int(window) if isinstance(window, int) and window > 0 else None


def projection(layer: Any, name: str) -> Any:
    """A decoder layer's projection ``name`` (its attention's or its MLP's: ``mlp``, Granite 4.0's
    ``shared_mlp``), or None."""
    found = getattr(layer.self_attn, name, None)
    mlp = getattr(layer, "mlp", None) or getattr(layer, "shared_mlp", None)
    return found if found is not None else getattr(mlp, name, None)


def norm_eps(norm: Any) -> float:
    """An RMSNorm module's epsilon (Llama's call it variance_epsilon, Gemma's eps)."""
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else norm.eps)


def norm_weight(norm: Any, ops: LayerOps) -> torch.Tensor:
    """The weight an RMSNorm multiplies by (Gemma's: 1 + its parameter, in fp32 as it computes)."""
    return norm.weight + ops.norm_offset if ops.norm_offset else norm.weight


def final_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """The model's own last steps on its head's output, as its ``ForCausalLM.forward`` takes them
    (Granite divides by ``logits_scaling``; Gemma soft-caps)."""
    divisor = getattr(config, "logits_scaling", None)
    if divisor is not None and float(divisor) != 1.0:
        logits = logits / divisor
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
