"""Runs a Hugging Face causal LM over the slab KV cache: batched prefill and decode.

The model's own modules do the work (so PEFT LoRA layers, weights the trainer just
updated, and the model's exact numerics all apply); only the cache and the mask are
ours. Any decoder that reads its keys/values through ``cache.update`` and accepts a
prepared 4-D mask works (the Llama family: Llama, SmolLM2, Mistral, Qwen2/3 without
sliding windows).

Decode: ``[N, 1]`` tokens for slots ``0..N-1``, each at its own position, with a
boolean mask ``[N, 1, 1, T]`` (key ``t`` visible iff ``t <= pos_r``): no padding
between tokens, no per-row Python. Prefill: ``[P, S]`` prompt chunks (right-padded to
the longest chunk) for any slots; logits only at each row's last real token.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from services.inference.engine.kv_cache import SlabKVCache


@dataclass
class PrefillRow:
    slot: int
    token_ids: list[int]
    start: int
    adapter: str | None = None


def base_model_of(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class ModelRunner:
    def __init__(self, model: Any, *, max_slots: int, max_len: int, device: Any = None) -> None:
        self.model = model
        base = base_model_of(model)
        self.config = base.config
        self.decoder = base.get_decoder()
        self.lm_head = base.get_output_embeddings()
        param = next(base.parameters())
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = param.dtype
        text_config = getattr(self.config, "text_config", None) or self.config
        heads = int(text_config.num_attention_heads)
        kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
        ctx = int(getattr(text_config, "max_position_embeddings", max_len) or max_len)
        self.max_len = min(max_len, ctx)
        self.cache = SlabKVCache(
            num_layers=int(text_config.num_hidden_layers),
            max_slots=max_slots,
            kv_heads=kv_heads,
            head_dim=head_dim,
            max_len=self.max_len,
            dtype=self.dtype,
            device=self.device,
        )
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._adapter_names: list[str] | None = None
        self._hooks: list[Any] = []
        self.pad_id = int(getattr(self.config, "pad_token_id", None) or 0)

    # --- LoRA: per-row adapters through PEFT's mixed-batch path -------------------------
    def refresh_adapter_hooks(self) -> None:
        """(Re)attach the hooks that hand each LoRA layer the per-row adapter names."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        try:
            from peft.tuners.lora import LoraLayer
        except ImportError:  # pragma: no cover - peft is a dependency
            return

        def hook(_: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if self._adapter_names is not None:
                kwargs = {**kwargs, "adapter_names": self._adapter_names}
            return args, kwargs

        for module in self.model.modules():
            if isinstance(module, LoraLayer) and isinstance(module, torch.nn.Module):
                self._hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    @contextmanager
    def _adapters(self, names: list[str] | None) -> Iterator[None]:
        self._adapter_names = names if self._hooks else None
        try:
            yield
        finally:
            self._adapter_names = None

    @contextmanager
    def _sdpa(self) -> Iterator[None]:
        # Our prepared 4-D boolean mask needs an attention that takes masks (a model loaded
        # for training may use flash/flashmask kernels); restored afterwards.
        previous = self.config._attn_implementation
        if previous not in ("sdpa", "eager"):
            self.config._attn_implementation = "sdpa"
        try:
            yield
        finally:
            if previous not in ("sdpa", "eager"):
                self.config._attn_implementation = previous

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.decoder(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: self.cache},
        )
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    # --- forwards -------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(
        self, tokens: list[int], positions: list[int], adapters: list[str] | None = None
    ) -> torch.Tensor:
        """One token for each of slots ``0..N-1``; returns logits ``[N, V]``."""
        n = len(tokens)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        att_len = max(positions) + 1
        self.cache.ensure_capacity(att_len)
        mask = (torch.arange(att_len, device=dev).unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, att_len)
        self.cache.plan_decode(n, pos, att_len)
        ids = torch.tensor(tokens, dtype=torch.long, device=dev).unsqueeze(1)
        with self._sdpa(), self._adapters(adapters):
            hidden = self._run(ids, pos.unsqueeze(1), mask)
            return self.lm_head(hidden[:, -1, :])

    @torch.inference_mode()
    def prefill(self, rows: list[PrefillRow], adapters: list[str] | None = None) -> torch.Tensor:
        """Prompt chunks for several slots at once; returns logits ``[P, V]`` at each row's last token."""
        dev = self.device
        width = max(len(r.token_ids) for r in rows)
        starts = torch.tensor([r.start for r in rows], dtype=torch.long, device=dev)
        positions = starts.unsqueeze(1) + torch.arange(width, device=dev).unsqueeze(0)
        att_len = int(positions.max()) + 1
        self.cache.ensure_capacity(att_len)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids, dtype=torch.long)
        ids = ids.to(dev)
        fresh = all(r.start == 0 for r in rows)
        key_len = width if fresh else att_len
        mask = (torch.arange(key_len, device=dev).view(1, 1, key_len) <= positions.unsqueeze(2)).unsqueeze(1)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long, device=dev)
        self.cache.plan_prefill(slots, positions, att_len, fresh)
        with self._sdpa(), self._adapters(adapters):
            hidden = self._run(ids, positions, mask)
            last = torch.tensor([len(r.token_ids) - 1 for r in rows], device=dev)
            picked = hidden[torch.arange(len(rows), device=dev), last]
            return self.lm_head(picked)
