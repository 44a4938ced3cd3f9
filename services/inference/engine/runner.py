"""Runs a Hugging Face causal LM over the slab KV cache: one mixed forward per step.

The model's own modules do the work (so PEFT LoRA layers, weights the trainer just
updated, and the model's exact numerics all apply); only the cache and attention are
ours. Any decoder that reads its keys/values through ``cache.update`` and calls its
attention through transformers' attention interface works (the Llama family: Llama,
SmolLM2, Mistral, Qwen2/3). A layer with a sliding attention window (``layer_ops``' window,
the model's attention module's) attends only the keys its window reaches, on every path
(``ragged.windowed``; the C++ loops take each layer's window), so such a model is served with
its whole context.

A forward takes decode tokens and prompt chunks of any slots together, flattened into
one token per batch row (``ragged.py`` holds the layout and the attention); it returns
logits for each decode token and at each chunk's last token.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from services.inference.engine import fused_decode, lora_rows, ragged
from services.inference.engine import native as native_module
from services.inference.engine.fused_decode import FusedDecode
from services.inference.engine.fused_prompt import FusedPrompt
from services.inference.engine.kv_cache import SlabKVCache
from services.inference.engine.layer_ops import final_logits
from services.inference.engine.packed_linear import PackedLinears
from services.inference.engine.plan import (
    ForwardPlan,
    ModelFacts,
    attentions,
    base_model_of,
    changes,
    in_state,
    kernel_choice,
    refusal,
    resolve_plan,
)
from services.inference.engine.prefix_cache import weights_fingerprint
from services.inference.engine.quantized_linear import PromptDType, Quantize
from services.inference.engine.ragged import DecodeRow, PrefillRow

__all__ = ["DecodeRow", "ModelRunner", "PrefillRow", "base_model_of"]

log = logging.getLogger("tandem.engine.runner")


class ModelRunner:
    def __init__(
        self,
        model: Any,
        *,
        max_slots: int,
        max_len: int,
        device: Any = None,
        plan: ForwardPlan | None = None,
    ) -> None:
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
        params = inspect.signature(self.decoder.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._adapter_names: list[str] | None = None
        self._hooks: list[Any] = []
        self._routed: list[Any] = []  # the LoRA linear layers whose rows _adapters routes
        self._attention_name = ragged.register()
        # a 4-D mask is passed through by transformers as is; ours attends by the plan instead
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        # what every part of a forward runs (plan.py): the runner builds what ``built_plan`` names
        # and runs ``plan``, that plan resolved again for the model's adapters and mode (``_replan``)
        plan = plan if plan is not None else resolve_plan(model, device=self.device)
        self.built_plan = self.plan = plan
        self.quantize: Quantize = plan.quantize
        self.prompt_dtype: PromptDType = plan.prompt_dtype
        self._facts = ModelFacts.of(model, self.device)
        # the plan's KV dtype for every forward the runner may take (a plan resolved again for an
        # adapter or training reads the same slabs: every path widens bf16 keys to its own dtype)
        self.cache = SlabKVCache(
            num_layers=int(text_config.num_hidden_layers),
            max_slots=max_slots,
            kv_heads=kv_heads,
            head_dim=head_dim,
            max_len=self.max_len,
            dtype=getattr(torch, plan.kv_dtype),
            device=self.device,
        )
        if plan.needs_native:
            # the C++ kernels, built (or loaded) before any forward; a plan made by hand that
            # names them stops here when they cannot be built
            native_module.start("on")
        problem = refusal(plan, self._facts)
        if problem is not None:
            raise ValueError(problem)
        choose = kernel_choice(plan, self.lm_head, max_slots)
        self.packed: PackedLinears | None = (
            PackedLinears(model, choose=choose) if choose is not None else None
        )
        # decode tokens through the lean forward where the plan names it (layer_ops.py: the families)
        # (fused_decode.py: the eager forward's numbers, without the modules' plumbing), prompt
        # chunks through theirs (fused_prompt.py)
        self.fused = FusedDecode(self, native=plan.decode == "native-own") if plan.lean_decode else None
        self.fused_prompt = (
            FusedPrompt(
                self,
                native=plan.prompt == "native",
                own_attention=plan.prompt == "native" and attentions(plan)[1] == "own",
                decode=self.fused,
            )
            if plan.lean_prompt
            else None
        )
        self._training = bool(self.decoder.training)
        self._lora_problem: str | None = None
        self._follow_adapters(None)

    def prepare_weights(self) -> None:
        """Pack/quantise every weight the forwards will use now (start-up), not in a request."""
        if self.packed is not None:
            # the lean forwards have their own weights: the layers' decode and prompt sides would
            # be second copies that nothing multiplies with (made when first asked, if ever)
            self.packed.pack_all(
                self.fused.multiplied() if self.fused is not None else frozenset(),
                self.fused_prompt.multiplied() if self.fused_prompt is not None else frozenset(),
            )
        for lean in (self.fused, self.fused_prompt):
            if lean is not None:
                lean.prepare()

    # --- slots (the scheduler's Runner protocol) -----------------------------------------
    @property
    def prefix_kv(self) -> SlabKVCache:
        return self.cache

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.cache.move(src, dst, length)

    def release(self, slot: int) -> None:
        """Nothing to free: the next sequence in the slot writes over its rows."""

    def reset(self) -> None:
        """Nothing to free: every slot is written over by its next sequence."""

    def weights_fingerprint(self) -> tuple[Any, ...]:
        # the model's parameters: the trainer updates them in place between rollouts
        return weights_fingerprint(self.model)

    # --- LoRA: per-row adapters through PEFT's mixed-batch path -------------------------
    def refresh_adapter_hooks(self, cause: str = "the adapters changed") -> None:
        """(Re)attach the hooks that hand each LoRA layer the per-row adapter names (and track
        the linear layers an adapter added or took away), and resolve the plan again for the
        adapters loaded now (``cause``: what changed, for the log line)."""
        if self.packed is not None:
            self.packed.refresh(self.model)
        self._attach_adapter_hooks()
        self._follow_adapters(cause)

    # --- the plan in the model's state ----------------------------------------------------
    def _follow_adapters(self, cause: str | None) -> None:
        """Whether the adapters on the model now can take the lean forwards, and the plan again."""
        self._lora_problem = fused_decode.lora_unsupported(
            self.model, self._facts.ops, self.decoder.layers, routed=bool(self._hooks)
        )
        for lean in (self.fused, self.fused_prompt):
            if lean is not None:
                lean.refresh(self._lora_problem)
        self._replan(cause)

    def _replan(self, cause: str | None) -> None:
        """Resolve the plan again for the model's adapters and mode (``plan.in_state``) and run it;
        a change is logged as one line (``cause``: what changed; None at construction, where the
        engine logs the whole plan)."""
        self._training = bool(self.decoder.training)
        plan = in_state(self.built_plan, lora_problem=self._lora_problem, training=self._training)
        if cause is not None and plan.paths() != self.plan.paths():
            log.info("forward plan changed (%s): %s", cause, changes(self.plan, plan))
        self.plan = plan
        # the lean forwards built for the built plan run the loop the current one names
        if self.fused is not None:
            self.fused.native = plan.decode == "native-own"
        if self.fused_prompt is not None:
            self.fused_prompt.native = plan.prompt == "native"
            self.fused_prompt.own_attention = plan.prompt == "native" and attentions(plan)[1] == "own"

    def _attach_adapter_hooks(self) -> None:
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
        self._routed = [m for m in self.model.modules() if lora_rows.routable(m)]

    @contextmanager
    def _adapters(self, names: list[str] | None) -> Iterator[lora_rows.LoraRows | None]:
        """Each row of this forward through its adapter: PEFT's linear LoRA layers through
        ``lora_rows.routed_forward`` (their rows found once, not scanned in every layer), any
        other LoRA layer (embeddings) through PEFT's own mixed batch. Yields the rows by adapter
        (None: no row has one), which the lean forward adds with too."""
        self._adapter_names = names if self._hooks else None
        rows = None
        if self._hooks and names is not None:
            rows = lora_rows.LoraRows.of(names, ragged.adapter_key(None), self.device, whole=True)
        if rows is not None:
            for module in self._routed:
                vars(module)["forward"] = functools.partial(lora_rows.routed_forward, module, rows)
        try:
            yield rows
        finally:
            self._adapter_names = None
            if rows is not None:
                for module in self._routed:
                    vars(module).pop("forward", None)

    @contextmanager
    def _ragged_attention(self) -> Iterator[None]:
        # the model's own attention implementation is restored afterwards (a model shared
        # with the trainer trains with its own kernels)
        previous = self.config._attn_implementation
        self.config._attn_implementation = self._attention_name
        try:
            yield
        finally:
            self.config._attn_implementation = previous

    @torch.inference_mode()
    def forward(self, decode: list[DecodeRow], prefill: list[PrefillRow]) -> torch.Tensor:
        """Logits ``[D + P, V]``: one row per decode token, then one at each chunk's last token."""
        if self.decoder.training != self._training:
            self._replan(
                "the model entered training mode" if self.decoder.training else "the model left training mode"
            )
        plan = self.plan
        lean_decode = self.fused if plan.lean_decode else None
        lean_prompt = self.fused_prompt if plan.lean_prompt else None
        if lean_decode is None and lean_prompt is None:
            return self._forward(decode, prefill, None)
        # decode tokens and prompt chunks in two forwards (disjoint slots), each kind of token
        # always through the same one: a token's numbers never depend on what shares its step
        if not prefill:
            return self._forward(decode, [], lean_decode)
        if not decode:
            return self._forward([], prefill, lean_prompt)
        return torch.cat([self._forward(decode, [], lean_decode), self._forward([], prefill, lean_prompt)])

    def _forward(
        self, decode: list[DecodeRow], prefill: list[PrefillRow], fused: FusedDecode | FusedPrompt | None
    ) -> torch.Tensor:
        plan = ragged.build_plan(decode, prefill, self.device)
        self.cache.ensure_capacity(plan.max_position + 1)
        self.cache.plan_writes(plan.write_slots, plan.write_positions)
        if fused is not None:
            # the lean forward multiplies its layers itself: only the others (the head) swap in
            packed = self.packed.active(fused.multiplied()) if self.packed is not None else nullcontext()
            with ragged.active(plan), self._adapters(plan.adapters) as rows, packed:
                return fused(plan, rows)
        packed = self.packed.active() if self.packed is not None else nullcontext()
        with ragged.active(plan), self._ragged_attention(), self._adapters(plan.adapters), packed:
            out = self.decoder(
                input_ids=plan.input_ids,
                attention_mask=self._no_mask,
                position_ids=plan.positions,
                use_cache=True,
                **{self._cache_kwarg: self.cache},
            )
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            # the model's own steps after its head (Granite's logits scaling, Gemma's soft-cap)
            return final_logits(self.config, self.lm_head(hidden[plan.logit_rows, 0]))
