"""PEFT LoRA adapter folder -> GGUF LoRA adapter, for the llama.cpp engine.

llama.cpp applies LoRA adapters only in its own GGUF form (``general.type = adapter``,
tensors ``<base tensor>.lora_a`` / ``.lora_b``). Its own converter
(``convert_lora_to_gguf.py``) ships with llama.cpp's sources, not with the
``llama-cpp-python`` wheel, and needs the base model's Hugging Face folder. What a
Llama-architecture adapter needs is small, so it is done here with the ``gguf`` package
(the same writer the converter uses):

- tensor names through ``gguf``'s own HF -> GGUF name map of the architecture;
- the rows of ``q_proj``/``k_proj`` B matrices permuted as llama.cpp's converter permutes
  the base weights of those projections (its RoPE layout), A matrices unchanged;
- ``adapter.lora.alpha`` such that llama.cpp's scale (alpha / rank) is PEFT's (alpha / r,
  or alpha / sqrt(r) with rsLoRA).

Anything else (another architecture, DoRA, per-module ranks or alphas, modules outside
the decoder's linear layers) is refused with a message naming the reason, since applying
it differently from PEFT would silently change the fine-tune's outputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# llama.cpp's converter permutes the base weights of these projections for its RoPE layout
_PERMUTED = {"q_proj": "q", "k_proj": "k"}


class LoraConversionError(ValueError):
    """The adapter cannot be converted (the message says why)."""


@dataclass(frozen=True)
class BaseShape:
    """What the conversion needs to know of the GGUF base model."""

    arch: str
    n_layers: int
    n_head: int
    n_head_kv: int


def _permute(rows: np.ndarray, n_head: int) -> np.ndarray:
    # the same reordering as llama.cpp's LlamaModel.permute, applied to B's output rows
    out = rows.shape[0]
    return rows.reshape(n_head, 2, out // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _load_tensors(folder: Path) -> dict[str, np.ndarray]:
    st = folder / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.numpy import load_file

        try:
            return {k: v.astype(np.float32) for k, v in load_file(str(st)).items()}
        except Exception:  # bf16 tensors: numpy has no bfloat16, read through torch
            from safetensors.torch import load_file as load_torch

            return {k: v.float().numpy() for k, v in load_torch(str(st)).items()}
    binary = folder / "adapter_model.bin"
    if binary.is_file():
        import torch

        state = torch.load(str(binary), map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise LoraConversionError("no adapter_model.safetensors or adapter_model.bin in the folder")


def _alpha(config: dict, rank: int) -> float:
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise LoraConversionError(f"per-module ranks or alphas ({field}) are not supported by llama.cpp")
    if config.get("use_dora"):
        raise LoraConversionError("DoRA adapters cannot be applied by llama.cpp")
    alpha = float(config.get("lora_alpha") or rank)
    if config.get("use_rslora"):
        # PEFT scales rsLoRA by alpha / sqrt(r); llama.cpp by alpha / r
        alpha *= math.sqrt(rank)
    return alpha


def convert_peft_lora(folder: Path, base: BaseShape, out: Path) -> Path:
    """Write ``folder``'s PEFT LoRA adapter as a GGUF adapter at ``out`` (atomically)."""
    import gguf

    if base.arch != "llama":
        raise LoraConversionError(
            f"converting PEFT adapters is implemented for the llama architecture only, the base is "
            f"{base.arch!r}; convert it with llama.cpp's convert_lora_to_gguf.py and load the .gguf"
        )
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LoraConversionError(f"unreadable adapter_config.json ({exc})") from None
    rank = int(config.get("r") or 0)
    if rank <= 0:
        raise LoraConversionError("adapter_config.json has no rank r")
    alpha = _alpha(config, rank)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, base.n_layers)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in _load_tensors(folder).items():
        part = "a" if ".lora_A." in key else "b" if ".lora_B." in key else None
        if part is None:
            raise LoraConversionError(f"tensor {key!r} is neither a LoRA A nor a LoRA B matrix")
        # base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight -> model.layers.0.self_attn.q_proj
        module = key.split(".lora_")[0].removeprefix("base_model.model.")
        target = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if target is None or not _LAYER.search(module):
            raise LoraConversionError(f"no llama.cpp tensor for the adapted module {module!r}")
        pairs.setdefault(target, {})[part] = value
    if not pairs:
        raise LoraConversionError("the adapter has no LoRA tensors")
    writer_tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(writer_tmp), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for target, pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            raise LoraConversionError(f"{target}: the adapter has only one of its A and B matrices")
        a, b = pair["a"], pair["b"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoraConversionError(f"{target}: a rank other than r={rank} ({a.shape}, {b.shape})")
        proj = next((p for p in _PERMUTED if f"attn_{_PERMUTED[p]}." in target), None)
        if proj == "q_proj":
            b = _permute(b, base.n_head)
        elif proj == "k_proj":
            b = _permute(b, base.n_head_kv)
        writer.add_tensor(f"{target}.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        writer.add_tensor(f"{target}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(writer_tmp, out)
    return out


def converted_path(folder: Path, cache_root: Path) -> Path:
    """Where the GGUF form of ``folder`` is cached: keyed by the adapter files' identity, so a
    republished adapter under the same path converts again."""
    parts = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        f = folder / name
        if f.is_file():
            st = f.stat()
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    tag = hashlib.sha256(f"{folder.resolve()}|{'|'.join(parts)}".encode()).hexdigest()[:16]
    return cache_root / "lora-gguf" / f"{folder.name}-{tag}.gguf"
