"""The built-in engine: any Hugging Face causal LM on any torch device, continuous batching.

Two faces over one scheduler:

- the server's: ``await engine.generate(EngineRequest)`` → async stream of ``StreamEvent``;
- the trainer's: ``TorchEngine.from_model(model, tokenizer)`` then the synchronous
  ``generate_batch(prompts, params)`` (runs the same scheduler inline when no scheduler
  thread is running, so it works inside a training loop with no event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from services.inference.engine.base import AdapterHost
from services.inference.engine.detokenizer import IncrementalDetokenizer
from services.inference.engine.guided import GuidedCompiler
from services.inference.engine.native import NativeDecode
from services.inference.engine.plan import Forward, ForwardPlan, PlanSettings, resolve_plan
from services.inference.engine.prefix_cache import PrefixCache
from services.inference.engine.quantized_linear import PromptDType, Quantize
from services.inference.engine.runner import ModelRunner
from services.inference.engine.sampling import make_generator
from services.inference.engine.scheduler import DEFAULT_TENANT, Scheduler, Sequence
from services.inference.engine.tools import fallback_messages, native_messages, template_renders_tools
from services.inference.engine.types import (
    AdapterError,
    ContextLengthExceeded,
    EngineRequest,
    EngineUnavailable,
    GenerationOutput,
    InvalidParams,
    SamplingParams,
    StreamEvent,
)

T = TypeVar("T")

log = logging.getLogger("tandem.engine.torch")


async def in_own_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a thread of its own that ends with it, for torch CPU work off the event
    loop (where ``asyncio.to_thread`` would use an executor thread that lives on). Each thread that
    runs torch's parallel CPU work keeps an OpenMP (libgomp) thread pool as long as it lives; with
    more pooled threads than cores, libgomp stops spinning between parallel regions and wakes its
    threads through the kernel each time, and the scheduler thread's forwards ran ~1.9x slower than
    the same forward on a process's only pool (2 cores; benchmarks/RESULTS.md, "Prompt tokens in
    bf16"). A thread that ends frees its pool."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name=f"tandem-{getattr(fn, '__name__', 'torch')}", daemon=True).start()
    return await future


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise InvalidParams("only text content parts are supported", "messages")
        return "".join(parts)
    raise InvalidParams(
        f"message content must be a string or a list of parts, got {type(content).__name__}", "messages"
    )


class TorchEngine(AdapterHost):
    kind = "torch"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str = "model",
        device: Any = None,
        max_batch_size: int = 16,
        max_queue: int = 256,
        prefill_chunk: int = 256,
        max_model_len: int | None = None,
        request_timeout: float | None = None,
        num_threads: int = 0,
        prefix_cache_mb: float = 64.0,
        admit_window: float = 0.0,
        quantize: Quantize = "none",
        tenant_max_queued: int | None = None,
        prompt_dtype: PromptDType = "auto",
        forward: Forward = "auto",
        native_decode: NativeDecode = "off",
        plan: ForwardPlan | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.request_timeout = request_timeout
        if device is not None:
            model.to(device)
        if plan is None:
            settings = PlanSettings(
                forward=forward, quantize=quantize, prompt_dtype=prompt_dtype, native_decode=native_decode
            )
            plan = resolve_plan(model, None, settings, device=device)
        self.runner = ModelRunner(
            model, max_slots=max_batch_size, max_len=max_model_len or 1 << 30, device=device, plan=plan
        )
        self.plan: ForwardPlan = plan
        self.max_model_len = self.runner.max_len
        self.device = self.runner.device
        self.model_lock = threading.RLock()
        self.scheduler = Scheduler(
            self.runner,
            tokenizer,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            eos_token_ids=_eos_ids(model, tokenizer),
            model_lock=self.model_lock,
            num_threads=num_threads,
            prefix_cache=PrefixCache(int(prefix_cache_mb * 2**20)),
            admit_window=admit_window,
            tenant_max_queued=tenant_max_queued,
        )
        self.adapters: dict[str, str] = {}
        self._renders_tools: bool | None = None
        self.vocab_size = int(getattr(getattr(model, "config", None), "vocab_size", 0) or len(tokenizer))
        self.guided = GuidedCompiler(tokenizer, self.vocab_size, _eos_ids(model, tokenizer))
        # the trainer's engine uses the model's active adapter as is; ours route per row
        self._own_adapters = False

    # --- construction ---------------------------------------------------------------------------
    @classmethod
    def from_model(
        cls, model: Any, tokenizer: Any, *, device: Any = None, max_batch_size: int = 16, **kwargs: Any
    ) -> TorchEngine:
        """Wrap an already-loaded HF causal LM (plain or PEFT) whose weights may change between calls."""
        return cls(model, tokenizer, device=device, max_batch_size=max_batch_size, **kwargs)

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

    # --- prompts -----------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not messages:
            raise InvalidParams("messages must not be empty", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise InvalidParams(f"messages[{i}] must be an object with a role", "messages")
            role = "system" if m["role"] == "developer" else m["role"]
            entry = {**m, "role": role, "content": _message_text(m.get("content"))}
            clean.append({k: v for k, v in entry.items() if v is not None})
        extra: dict[str, Any] = {}
        history = any(m.get("tool_calls") or m.get("role") == "tool" for m in clean)
        if tools or history:
            tools = tools or []
            if self.template_renders_tools():
                clean, extra = native_messages(clean), ({"tools": tools} if tools else {})
            else:
                clean = fallback_messages(clean, tools)
        else:
            clean = [{"role": m["role"], "content": m["content"]} for m in clean]
        try:
            out = self.tokenizer.apply_chat_template(
                clean, add_generation_prompt=True, tokenize=True, **extra
            )
        except Exception as exc:
            raise InvalidParams(f"the chat template rejected the messages: {exc}", "messages") from None
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(x) for x in ids]

    def template_renders_tools(self) -> bool:
        """Whether the chat template has a tool format: rendering with a tool changes the prompt."""
        if self._renders_tools is None:
            self._renders_tools = template_renders_tools(self.tokenizer)
        return self._renders_tools

    def fim_tokens(self) -> tuple[str, str, str] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle) when the vocabulary has them."""
        vocab = self.tokenizer.get_vocab()
        for names in (
            ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
            ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
        ):
            if all(n in vocab for n in names):
                return names
        return None

    def encode_text(self, prompt: str) -> list[int]:
        return [int(x) for x in self.tokenizer(prompt, add_special_tokens=True)["input_ids"]]

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            vocab = len(self.tokenizer)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidParams(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
        elif request.messages is not None:
            ids = self.encode_chat(request.messages, request.tools)
        elif request.suffix is not None:
            fim = self.fim_tokens()
            if fim is None:
                raise InvalidParams(f"suffix: model {self.name!r} has no fill-in-the-middle tokens", "suffix")
            # prefix-suffix-middle order, as StarCoder-style models (and SmolLM2's tokenizer) expect
            ids = self.encode_text(f"{fim[0]}{request.prompt or ''}{fim[1]}{request.suffix}{fim[2]}")
        else:
            ids = self.encode_text(request.prompt or "")
        if not ids:
            raise InvalidParams("the prompt is empty", "prompt")
        return ids

    def _resolve_max_tokens(self, prompt_len: int, params: SamplingParams, strict: bool) -> int:
        limit = self.max_model_len
        what = "messages" if strict else "prompt"
        if prompt_len >= limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your {what} resulted "
                f"in {prompt_len} tokens; reduce the length of the {what}.",
                limit,
            )
        room = limit - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            if not strict:
                return room
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the {what}, {params.max_tokens} "
                "in the completion). Please reduce the length of the messages or completion.",
                limit,
            )
        return params.max_tokens

    def _sequences(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        sink: Callable[[StreamEvent], None],
        *,
        adapter: str | None,
        timeout: float | None,
        strict: bool,
        index_base: int = 0,
        grammar: Any = None,
        tenant: str | None = None,
    ) -> list[Sequence]:
        max_tokens = self._resolve_max_tokens(len(prompt), params, strict)
        deadline = time.monotonic() + timeout if timeout else None
        seqs = []
        for j in range(params.n):
            seed = None if params.seed is None else params.seed + index_base + j  # distinct per choice
            detok = (
                IncrementalDetokenizer(self.tokenizer, prompt, params.stop, params.skip_special_tokens)
                if params.detokenize or params.stop
                else None
            )
            seqs.append(
                Sequence(
                    request_id=request_id,
                    index=index_base + j,
                    prompt_ids=prompt,
                    params=params,
                    max_tokens=max_tokens,
                    sink=sink,
                    generator=make_generator(seed, self.device) if params.temperature > 0 else None,
                    detok=detok,
                    adapter=adapter,
                    deadline=deadline,
                    matcher=GuidedCompiler.matcher(grammar) if grammar is not None else None,
                    tenant=tenant or DEFAULT_TENANT,
                )
            )
        return seqs

    # --- the trainer's face -------------------------------------------------------------------------
    def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """Generate for each prompt (``n`` outputs per prompt, prompt-major) through the scheduler.

        Blocks until all are done. A prompt plus ``max_tokens`` beyond the context is cut to
        the context rather than refused.
        """
        params.validate()
        params.check_vocab(self.vocab_size)
        if not prompts:
            return []
        grammar = self.guided.compile(params.guided) if params.guided is not None else None
        request_id = f"batch-{id(prompts)}-{time.monotonic_ns()}"
        results: dict[int, GenerationOutput] = {}
        texts: dict[int, list[str]] = {}
        done = threading.Event()
        total = len(prompts) * params.n
        lock = threading.Lock()
        seq_of: dict[int, Sequence] = {}

        def sink(ev: StreamEvent) -> None:
            with lock:
                texts.setdefault(ev.index, []).append(ev.text)
                if ev.finish_reason is not None and ev.index not in results:
                    seq = seq_of[ev.index]
                    results[ev.index] = GenerationOutput(
                        prompt_token_ids=list(seq.prompt_ids),
                        token_ids=list(seq.output_ids),
                        logprobs=list(seq.logprobs),
                        finish_reason=ev.finish_reason,
                        text="".join(texts[ev.index]),
                    )
                    if len(results) == total:
                        done.set()

        seqs: list[Sequence] = []
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidParams(f"prompt {i} is empty", "prompts")
            seqs += self._sequences(
                request_id,
                list(prompt),
                params,
                sink,
                adapter=None,
                timeout=None,
                strict=False,
                index_base=i * params.n,
                grammar=grammar,
            )
        for seq in seqs:
            seq_of[seq.index] = seq
        was_training = bool(getattr(self.model, "training", False))
        self.model.eval()
        try:
            self.scheduler.submit(seqs, bounded=False)
            if self.scheduler.running:
                done.wait()
            else:
                self.scheduler.run_until_done()
        finally:
            if was_training:
                self.model.train()
        return [results[i] for i in range(total)]

    # --- the server's face (Engine protocol) ------------------------------------------------------
    async def start(self) -> None:
        log.info("forward plan: %s: %s", self.name, self.plan.line())
        # pack (or quantise) the weights before serving, so the first request does not pay for it
        await in_own_thread(self.runner.prepare_weights)
        self.scheduler.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.scheduler.stop)

    async def health(self) -> dict[str, object]:
        if not self.scheduler.running:
            raise EngineUnavailable("the scheduler thread is not running")
        return {
            "engine": self.kind,
            "model": self.name,
            **self.scheduler.load(),
            "forward_plan": self.plan.as_dict(),
        }

    async def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        request.params.validate()
        request.params.check_vocab(self.vocab_size)
        adapter = request.model if request.model in self.adapters else None
        prompt = self.prompt_ids(request)
        grammar = None
        if request.params.guided is not None:
            # compiling takes milliseconds to seconds (cached per schema): off the event loop
            grammar = await asyncio.to_thread(self.guided.compile, request.params.guided)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamEvent] = asyncio.Queue()

        def sink(ev: StreamEvent) -> None:
            # RuntimeError: the loop is gone (shutdown), nobody is listening
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, ev)

        timeout = request.timeout if request.timeout is not None else self.request_timeout
        seqs = self._sequences(
            request.request_id,
            prompt,
            request.params,
            sink,
            adapter=adapter,
            timeout=timeout,
            strict=request.messages is not None or request.prompt is not None,
            grammar=grammar,
            tenant=request.tenant,
        )
        if request.echo:
            # the prompt goes out first, as each choice's first text (OpenAI's echo)
            text = str(self.tokenizer.decode(prompt, skip_special_tokens=True))
            for seq in seqs:
                queue.put_nowait(StreamEvent(seq.index, [], text, None, None, len(prompt), 0))
        self.scheduler.submit(seqs)
        return self._stream(request.request_id, queue, len(seqs))

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[StreamEvent], count: int
    ) -> AsyncIterator[StreamEvent]:
        remaining = count
        try:
            while remaining:
                ev = await queue.get()
                if ev.finish_reason is not None:
                    remaining -= 1
                yield ev
        finally:
            if remaining:
                # the client went away (or the consumer stopped): free the slots now
                self.scheduler.abort(request_id)

    # --- LoRA adapters ------------------------------------------------------------------------------
    async def load_adapter(self, name: str, path: str) -> None:
        await in_own_thread(self.load_adapter_sync, name, path)

    async def unload_adapter(self, name: str) -> None:
        await in_own_thread(self.unload_adapter_sync, name)

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
            self._own_adapters = True
            self.runner.model = self.model
            self.runner.refresh_adapter_hooks()
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
            self.runner.refresh_adapter_hooks()
            # a later adapter of the same name must not find this one's keys/values
            self.scheduler.prefix_cache.clear()
