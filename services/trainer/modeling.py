"""Model components: loading with the FlashMask attention, LoRA, and per-token log-probs.

Log-probs are computed from the decoder's hidden states through the output head at label
positions only. Up to ``HEAD_SAVE_ELEMENTS`` logits the head runs once and its log-softmax
is kept for the backward; above that it runs in chunks, each recomputed in the backward
pass (activation checkpointing), so a long pack times a large vocabulary never holds all
its fp32 logits and their gradient at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger("tandem.trainer.modeling")

HEAD_CHUNK = 1024
# Up to this many logits (label rows x vocabulary; 1 GiB of fp32) the head runs in one call
# and autograd keeps its log-softmax for the backward: recomputing it (checkpointing) costs
# a whole extra head forward, which on a small model with a 49K vocabulary is most of a
# packed step's matmuls. Bigger packs (long context, large vocabularies) are chunked and
# recomputed so no more than HEAD_CHUNK rows of logits exist at once.
HEAD_SAVE_ELEMENTS = 1 << 28
ATTN = "flashmask"


class ModelError(ValueError):
    pass


def attention_name() -> str:
    """Register the kernels' attention with transformers (idempotent) and return its name."""
    import tandem_kernels

    return str(tandem_kernels.register_hf_attention())


def load_causal_lm(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    attn: str = ATTN,
) -> Any:
    from transformers import AutoModelForCausalLM

    impl = attention_name() if attn == ATTN else attn
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype or torch.float32, attn_implementation=impl
    )
    if device is not None:
        model.to(device)  # type: ignore[arg-type]
    return model


def linear_module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def check_lora_targets(model_path: str | Path, targets: Sequence[str]) -> None:
    """Refuse LoRA targets that name no linear layer of the model (built on the meta device: no weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = linear_module_names(skeleton)
    missing = [t for t in targets if t not in names]
    if missing:
        raise ModelError(
            f"lora.target_modules: {', '.join(repr(m) for m in missing)} not found in the model "
            f"(its linear layers: {', '.join(sorted(names))})"
        )


def apply_lora(model: Any, r: int, alpha: float, dropout: float, targets: Sequence[str]) -> Any:
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # floats work; the stub says int
        lora_dropout=dropout,
        target_modules=list(targets),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


def base_lm(model: Any) -> Any:
    """The underlying ``*ForCausalLM`` (through a PEFT wrapper)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def hidden_states(
    model: Any,
    input_ids: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    startend_row_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Last hidden states ``[B, S, H]`` of the decoder (no logits)."""
    lm = base_lm(model)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if startend_row_indices is not None:
        kwargs["startend_row_indices"] = startend_row_indices
    out = lm.get_decoder()(**kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def pack_hidden_states(model: Any, pack: Any) -> torch.Tensor:
    """Last hidden states of a packed sequence (``data.packing.Pack``) under its own FlashMask
    mask (documents, a shared question, or prompt groups), on the model's device."""
    device = next(model.parameters()).device
    return hidden_states(
        model,
        pack.input_ids.to(device),
        position_ids=pack.position_ids.to(device),
        startend_row_indices=pack.mask().to(device),
    )


def _chunk_logps(head: nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(h).float()
    return logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def gather_logps(model: Any, hidden: torch.Tensor, src: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Log-prob of ``targets[i]`` under the logits at flat position ``src[i]`` of ``hidden``."""
    head = base_lm(model).get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1])
    picked = flat.index_select(0, src.to(flat.device))
    targets = targets.to(flat.device)
    vocab = int(head.weight.shape[0])
    if picked.shape[0] * vocab <= HEAD_SAVE_ELEMENTS:
        return _chunk_logps(head, picked, targets)
    parts = []
    for start in range(0, picked.shape[0], HEAD_CHUNK):
        h = picked[start : start + HEAD_CHUNK]
        t = targets[start : start + HEAD_CHUNK]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_logps, head, h, t, use_reentrant=False))
        else:
            parts.append(_chunk_logps(head, h, t))
    return torch.cat(parts) if parts else picked.new_zeros(0)


def label_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions, targets) of every label that is not -100 (labels already shifted)."""
    flat = labels.reshape(-1)
    pos = (flat != -100).nonzero().squeeze(-1)
    return pos, flat[pos]


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def count_params(model: nn.Module) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, total


class PackForward(nn.Module):
    """The model's decoder and output head in one ``forward``: DDP and FSDP hook the
    wrapped module's forward, and the recipes call the decoder and the head separately
    (the head at label positions only), so the wrapper makes both one call."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        src: torch.Tensor,
        targets: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        startend_row_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = hidden_states(
            self.model,
            input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            startend_row_indices=startend_row_indices,
        )
        return gather_logps(self.model, h, src, targets)


def label_logps(
    model: Any,
    input_ids: torch.Tensor,
    src: torch.Tensor,
    targets: torch.Tensor,
    **masks: torch.Tensor | None,
) -> torch.Tensor:
    """Log-probs of ``targets`` at flat positions ``src`` (``masks``: ``PackForward``'s
    position_ids, attention_mask, startend_row_indices). ``model`` is a causal LM, or under
    torchrun the data-parallel wrapper (``DistContext.dp``), so the recipes' forwards are the
    same code in one process and on every rank; the inputs go to the model's device."""
    fwd = (
        model if isinstance(model, PackForward | nn.parallel.DistributedDataParallel) else PackForward(model)
    )
    dev = next(fwd.parameters()).device
    out: torch.Tensor = fwd(
        input_ids.to(dev),
        src.to(dev),
        targets.to(dev),
        **{k: None if v is None else v.to(dev) for k, v in masks.items()},
    )
    return out
