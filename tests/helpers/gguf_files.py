"""GGUF files of a Llama-architecture model in the quantisation types people download, written
with the ``gguf`` package's writer (the same one llama.cpp's converter uses).

The tensor types follow llama.cpp's ``llama-quantize`` mixes: ``Q4_K_M`` is Q4_K with Q6_K for
``attn_v``/``ffn_down`` in some layers and for the output head, ``Q5_K_M`` the same with Q5_K,
and a K-quant whose rows are not whole 256-value super-blocks falls back as llama.cpp's does
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0). ``gguf.quants`` quantises the legacy types
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); the K-quants it only de-quantises, so their blocks are written
here (``quantize_k``): well-formed blocks by the format's layout, values chosen by each
sub-block's range (llama.cpp searches its scales harder; the layout is what matters here).
The tokenizer and chat template are copied from the default model's GGUF.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

QK_K = 256
# llama.cpp's fallback where a row is not whole super-blocks
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
# each file type's main type, the type of its "more bits" layers and of its output head
MIXES: dict[str, tuple[str, str, str]] = {
    "F16": ("F16", "F16", "F16"),
    "Q8_0": ("Q8_0", "Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0", "Q6_K"),
    "Q4_1": ("Q4_1", "Q4_1", "Q6_K"),
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K", "Q6_K"),
    "Q6_K": ("Q6_K", "Q6_K", "Q6_K"),
}


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)


def _k_levels(
    sub: np.ndarray, levels: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: each 32-value sub-block as ``q * d * sc - dmin * m`` (``levels`` - 1 the top q)."""
    low = np.minimum(sub.min(axis=-1), 0)  # a sub-block's minimum is at most 0
    span = (sub.max(axis=-1) - low) / (levels - 1)
    d = (span.max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(axis=-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(span, d, out=np.zeros_like(span), where=d > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-low, dmin, out=np.zeros_like(low), where=dmin > 0)), 0, 63).astype(
        np.uint8
    )
    scale = d * sc
    offset = dmin * m
    q = np.divide(
        sub + offset[..., None], scale[..., None], out=np.zeros_like(sub), where=scale[..., None] > 0
    )
    q = np.clip(np.round(q), 0, levels - 1).astype(np.uint8)
    return q, sc, m, d, dmin


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 6-bit scales and minima in Q4_K's 12 bytes (the inverse of ``gguf.quants.Q4_K.get_scale_min``)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=-1).astype(np.uint8)


def quantize_k(rows: np.ndarray, type_name: str) -> np.ndarray:
    """``rows`` ``[..., n * 256]`` as Q4_K / Q5_K / Q6_K blocks (uint8, GGUF's byte shape)."""
    shape = rows.shape
    blocks = rows.astype(np.float32).reshape(-1, QK_K)
    n = blocks.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        levels = 16 if type_name == "Q4_K" else 32
        q, sc, m, d, dmin = _k_levels(blocks.reshape(n, 8, 32), levels)
        head = [_f16(d), _f16(dmin), _pack_scales(sc, m)]
        low4 = (q & 0x0F).reshape(n, 4, 2, 32)  # chunk c: sub-blocks 2c (low nibble), 2c + 1 (high)
        qs = (low4[:, :, 0] | (low4[:, :, 1] << 4)).reshape(n, 128)
        if type_name == "Q4_K":
            out = np.concatenate([*head, qs], axis=-1)
        else:
            high = (q >> 4) & 1  # bit j of byte i: sub-block j's value i
            qh = np.zeros((n, 32), dtype=np.uint8)
            for j in range(8):
                qh |= high[:, j] << j
            out = np.concatenate([*head, qh, qs], axis=-1)
    elif type_name == "Q6_K":
        sub = blocks.reshape(n, 16, 16)
        amax = np.abs(sub).max(axis=-1)
        scale = amax / 31
        d = (scale.max(axis=-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 127).astype(
            np.int8
        )
        eff = (d * sc)[..., None]
        q = np.divide(sub, eff, out=np.zeros_like(sub), where=eff > 0)
        u = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 2, 64)  # half, nibble, i
        ql = ((u[:, :, 0] & 0x0F) | ((u[:, :, 1] & 0x0F) << 4)).reshape(n, 128)
        hi = (u >> 4).reshape(n, 2, 4, 32)  # half, 2-bit slot, i
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(n, 64)
        out = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=-1)
    else:
        raise ValueError(type_name)
    return out.reshape(*shape[:-1], -1)


def quantize(rows: np.ndarray, type_name: str) -> tuple[np.ndarray, Any]:
    """``rows`` as GGUF data of ``type_name`` and the ``raw_dtype`` to write it with."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return quantize_k(rows, type_name), qtype
    data = gguf.quants.quantize(rows.astype(np.float32), qtype)
    return data, (None if type_name in ("F32", "F16") else qtype)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's layers whose ``attn_v``/``ffn_down`` take the mix's larger type."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def gguf_name(hf_name: str) -> str:
    """A Llama or Qwen3 tensor's GGUF name (``model.layers.3.self_attn.q_proj.weight`` ->
    ``blk.3.attn_q.weight``)."""
    parts = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }
    stem = hf_name.removesuffix(".weight")
    if stem == "model.embed_tokens":
        return "token_embd.weight"
    if stem == "model.norm":
        return "output_norm.weight"
    if stem == "lm_head":
        return "output.weight"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{parts[rest]}.weight"


def tensor_type(mix: str, name: str, shape: tuple[int, ...], layers: int, tied: bool) -> str:
    """The type ``mix`` gives the tensor ``name`` (GGUF name) of ``shape`` ([out, in])."""
    main, more, head = MIXES[mix]
    if len(shape) == 1:
        return "F32"
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        chosen = head
    elif name == "token_embd.weight":
        chosen = main
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(
        int(name.split(".")[1]), layers
    ):
        chosen = more
    else:
        chosen = main
    if chosen in K_FALLBACK and shape[-1] % QK_K:
        chosen = K_FALLBACK[chosen]
    return chosen


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter reorders q/k rows for its RoPE layout (transformers reverses it)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@cache
def _tokenizer_fields(source: Path) -> list[tuple[str, Any, Any, Any]]:
    """``source``'s tokenizer fields (name, value, type, item type), read once a process (parsing a
    49K-token vocabulary takes seconds)."""
    import gguf

    out = []
    for name, field in gguf.GGUFReader(str(source)).fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((name, field.contents(), vtype, sub))
    return out


def _copy_tokenizer(writer: Any, source: Path, vocab: int | None) -> None:
    """The tokenizer fields of ``source``; with ``vocab``, its first ``vocab`` tokens and the
    merges among them (a smaller byte-level BPE of the same kind: the special tokens and the 256
    bytes come first, then each merge's token in the merges' order)."""
    kept: set[str] = set()
    for name, value, vtype, sub in _tokenizer_fields(source):
        if vocab is not None and name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:vocab]
            if name == "tokenizer.ggml.tokens":
                kept = set(value)
        if vocab is not None and name == "tokenizer.ggml.merges":
            value = [m for m in value if "".join(m.split(" ")) in kept and set(m.split(" ")) <= kept]
        writer.add_key_value(name, value, vtype, sub_type=sub)


def write_llama_gguf(
    model: Any,
    path: Path,
    mix: str | Callable[[str, tuple[int, ...]], str],
    *,
    tokenizer_from: Path | None = None,
) -> dict[str, str]:
    """Write the Llama or Qwen3 ``model`` (a transformers model) to ``path`` as a GGUF in the
    tensor types of ``mix`` (a key of ``MIXES``, or a function of a tensor's GGUF name and shape),
    with the default model's tokenizer cut to the model's vocabulary; return each tensor's type by
    GGUF name."""
    import gguf
    import torch

    from services.inference.engine.loader import default_gguf_path

    config = model.config
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(config.num_key_value_heads)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    arch = {"llama": "llama", "qwen3": "qwen3"}[config.model_type]
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or 10000.0))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != int(config.hidden_size) // heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(int(config.vocab_size))
    # a model whose vocabulary is smaller than the tokenizer's keeps the tokenizer's first tokens
    _copy_tokenizer(writer, tokenizer_from or default_gguf_path(), int(config.vocab_size))
    types: dict[str, str] = {}
    state: Mapping[str, torch.Tensor] = model.state_dict()
    for hf_name, tensor in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name)
        w = tensor.detach().float().numpy()
        # llama.cpp's converter permutes Llama's q/k rows only (Qwen's RoPE is its NeoX layout)
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = _permute(w, heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = _permute(w, kv_heads)
        chosen = mix(name, w.shape) if callable(mix) else tensor_type(mix, name, w.shape, layers, tied)
        data, raw_dtype = quantize(np.ascontiguousarray(w), chosen)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        types[name] = chosen
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types
