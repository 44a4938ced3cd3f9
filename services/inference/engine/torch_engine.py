"""The built-in engine: any Hugging Face causal LM on any torch device, continuous batching.

Two faces over one scheduler (``SchedulerEngine``, shared with the llama.cpp engine):

- the server's: ``await engine.generate(EngineRequest)`` → async stream of ``StreamEvent``;
- the trainer's: ``TorchEngine.from_model(model, tokenizer)`` then the synchronous
  ``generate_batch(prompts, params)`` (runs the same scheduler inline when no scheduler
  thread is running, so it works inside a training loop with no event loop).

What is torch's own: the ``ModelRunner`` over the model, the forward plan it runs, PEFT
adapters loaded onto the model, and the trainer's model kept in eval mode while it generates.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.inference.engine import defaults
from services.inference.engine import prompt_lookup as prompt_lookup_module
from services.inference.engine.native import NativeDecode
from services.inference.engine.plan import Forward, ForwardPlan, KVDType, PlanSettings, resolve_plan
from services.inference.engine.prompt_lookup import PromptLookup, PromptLookupMode
from services.inference.engine.quantized_linear import PromptDType, Quantize
from services.inference.engine.runner import ModelRunner
from services.inference.engine.scheduler_engine import SchedulerEngine
from services.inference.engine.types import AdapterError

log = logging.getLogger("tandem.engine.torch")


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


class TorchEngine(SchedulerEngine[ModelRunner]):
    """The ``Engine`` protocol over a torch ``ModelRunner``. The constructor's defaults are the
    server's (``defaults.py``); ``from_model``, the trainer's, keeps the rollouts unquantised."""

    kind = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "model",
        device: Any = None,
        max_batch_size: int = defaults.MAX_BATCH_SIZE,
        max_queue: int = defaults.MAX_QUEUE,
        prefill_chunk: int = defaults.PREFILL_CHUNK,
        max_model_len: int | None = defaults.MAX_MODEL_LEN,
        request_timeout: float | None = defaults.REQUEST_TIMEOUT_S,
        num_threads: int = defaults.THREADS,
        prefix_cache_mb: float = defaults.PREFIX_CACHE_MB,
        admit_window: float = defaults.ADMIT_WINDOW_MS / 1000,
        quantize: Quantize = defaults.QUANTIZE,
        tenant_max_queued: int | None = defaults.TENANT_MAX_QUEUED,
        stall_after: float = defaults.STALL_S,
        prompt_dtype: PromptDType = defaults.PROMPT_DTYPE,
        forward: Forward = defaults.FORWARD,
        native_decode: NativeDecode = defaults.NATIVE_DECODE,
        kv_dtype: KVDType = defaults.KV_DTYPE,
        plan: ForwardPlan | None = None,
        prompt_lookup: PromptLookupMode = defaults.PROMPT_LOOKUP,
        prompt_lookup_sizes: PromptLookup | None = None,
    ) -> None:
        """``max_model_len`` None: the model's own context. ``plan``: run this forward plan
        instead of resolving one from ``forward``/``quantize``/``prompt_dtype``/``native_decode``/
        ``kv_dtype``.
        ``prompt_lookup``: draft tokens from the sequence's own text (``prompt_lookup.py``), with
        ``prompt_lookup_sizes`` (None: the defaults)."""
        self.model = model
        if device is not None:
            model.to(device)
        if plan is None:
            settings = PlanSettings(
                forward=forward,
                quantize=quantize,
                prompt_dtype=prompt_dtype,
                native_decode=native_decode,
                kv_dtype=kv_dtype,
            )
            plan = resolve_plan(model, None, settings, device=device)
        device_type = (
            torch.device(device).type if device is not None else next(model.parameters()).device.type
        )
        lookup = prompt_lookup_module.resolve(prompt_lookup, device_type, prompt_lookup_sizes)
        plan = prompt_lookup_module.in_plan(plan, prompt_lookup, lookup)
        runner = ModelRunner(
            model, max_slots=max_batch_size, max_len=max_model_len or 1 << 30, device=device, plan=plan
        )
        eos = _eos_ids(model, tokenizer)
        super().__init__(
            runner,
            tokenizer,
            name=name,
            eos_token_ids=eos,
            vocab_size=int(getattr(getattr(model, "config", None), "vocab_size", 0) or len(tokenizer)),
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            request_timeout=request_timeout,
            num_threads=num_threads,
            prefix_cache_mb=prefix_cache_mb,
            admit_window=admit_window,
            tenant_max_queued=tenant_max_queued,
            stall_after=stall_after,
            prompt_lookup=lookup,
        )

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        model: Any,
        tokenizer: Any,
        *,
        device: Any = None,
        max_batch_size: int = defaults.MAX_BATCH_SIZE,
        quantize: Quantize = "none",
        max_model_len: int | None = None,
        **kwargs: Any,
    ) -> TorchEngine:
        """Wrap an already-loaded HF causal LM (plain or PEFT) whose weights may change between calls.

        The trainer's rollouts: unquantised unless asked (their log-probabilities are the
        policy's own, which the loss compares with the training forward's), over the model's
        own context (the prompts are a dataset's, not a served budget)."""
        return cls(
            model,
            tokenizer,
            device=device,
            max_batch_size=max_batch_size,
            quantize=quantize,
            max_model_len=max_model_len,
            **kwargs,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: Any = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        tokenizer_fallback: str | Path | None = None,
        **kwargs: Any,
    ) -> TorchEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError):
            # a fine-tune saved without its tokenizer: the base model's is the right one
            if tokenizer_fallback is None:
                raise
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_fallback))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
        model.eval()
        return cls(model, tokenizer, name=name or Path(path).name, device=device, **kwargs)

    # --- the trainer's face -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        # the trainer's model generates in eval mode and goes back to training after
        was_training = bool(getattr(self.model, "training", False))
        self.model.eval()
        try:
            yield
        finally:
            if was_training:
                self.model.train()

    @property
    def plan(self) -> ForwardPlan:
        """The forward plan the engine runs now (resolved again by the runner when an adapter load
        or a training-mode switch changes what it depends on)."""
        return self.runner.plan

    # --- the server's face (Engine protocol) ------------------------------------------------------
    async def start(self) -> None:
        log.info("forward plan: %s: %s", self.name, self.plan.line())
        # packs (or quantises) the weights before serving
        await super().start()

    async def health(self) -> dict[str, object]:
        return {**await super().health(), "forward_plan": self.plan.as_dict()}

    # --- LoRA adapters ------------------------------------------------------------------------------
    def load_adapter_sync(self, name: str, path: str) -> None:
        folder = Path(path)
        config_file = folder / "adapter_config.json"
        if not folder.is_dir():
            raise AdapterError(f"lora_path {path!r} is not a folder")
        if not config_file.is_file():
            raise AdapterError(f"lora_path {path!r} is not a PEFT adapter folder (no adapter_config.json)")
        try:
            config = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise AdapterError(f"lora_path {path!r}: unreadable adapter_config.json ({exc})") from None
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise AdapterError(
                f"lora_path {path!r} holds a {config.get('peft_type')} adapter; only LoRA is served"
            )
        if config.get("use_dora"):
            # PEFT's mixed batch cannot route DoRA per row (its magnitude vector scales the base too)
            raise AdapterError(
                f"lora_path {path!r} holds a DoRA adapter (use_dora); only plain LoRA is served"
            )
        from peft import PeftModel

        with self.model_lock:
            self.check_free(name)
            try:
                if isinstance(self.model, PeftModel):
                    self.model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
                else:
                    self.model = PeftModel.from_pretrained(
                        self.model, str(folder), adapter_name=name, is_trainable=False
                    )
            except Exception as exc:
                self._drop_adapter_modules(name)
                raise AdapterError(
                    f"lora_path {path!r} could not be loaded onto {self.name}: {exc}"
                ) from None
            self.model.to(self.device)
            self.model.eval()
            self.adapters[name] = str(folder)
            self.runner.model = self.model
            self.runner.refresh_adapter_hooks(f"adapter {name!r} loaded")
            self.scheduler.prefix_cache.clear()

    def _drop_adapter_modules(self, name: str) -> None:
        from peft import PeftModel

        if isinstance(self.model, PeftModel) and name in getattr(self.model, "peft_config", {}):
            try:
                if len(self.model.peft_config) == 1:
                    self.model = self.model.unload()
                else:
                    self.model.delete_adapter(name)
            except Exception:  # best effort cleanup of a half-loaded adapter
                pass

    def unload_adapter_sync(self, name: str) -> None:
        with self.model_lock:
            self.check_loaded(name)
            self.scheduler.fail_where(lambda s: s.adapter == name, f"adapter {name!r} was unloaded")
            self._drop_adapter_modules(name)
            del self.adapters[name]
            self.runner.model = self.model
            self.runner.refresh_adapter_hooks(f"adapter {name!r} unloaded")
            # a later adapter of the same name must not find this one's keys/values
            self.scheduler.prefix_cache.clear()
