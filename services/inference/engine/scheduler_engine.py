"""``SchedulerEngine``: the request handling of every engine that runs the ``Scheduler``.

The torch engine (``torch_engine.py``) and the llama.cpp engine (``llamacpp_engine.py``)
differ only in their model runner and how LoRA adapters load onto it. Everything between a
request and the runner is here, once:

- prompts: chat rendering through the Hugging Face tokenizer's template (tools natively or
  through the fallback format), fill-in-the-middle, token ids checked against the vocabulary;
- validation: sampling parameters, the context length (``max_tokens`` resolved against it);
- the server's face (the ``Engine`` protocol): ``generate`` streams, aborts, health, start and
  shutdown of the scheduler thread, adapters' async loading;
- the trainer's face: the synchronous ``generate_batch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from services.inference.engine import defaults
from services.inference.engine.base import AdapterHost
from services.inference.engine.detokenizer import IncrementalDetokenizer
from services.inference.engine.guided import GuidedCompiler
from services.inference.engine.prefix_cache import PrefixCache
from services.inference.engine.prompt_lookup import PromptLookup
from services.inference.engine.runner_protocol import Runner
from services.inference.engine.sampling import make_generator
from services.inference.engine.scheduler import DEFAULT_TENANT, Scheduler, Sequence
from services.inference.engine.tool_formats import ToolFormat
from services.inference.engine.tool_formats import select as select_tool_format
from services.inference.engine.tools import (
    chat_template_input,
    template_renders_calls,
    template_renders_tools,
)
from services.inference.engine.types import (
    ContextLengthExceeded,
    EngineRequest,
    GenerationOutput,
    InvalidParams,
    PromptMessage,
    SamplingParams,
    StreamEvent,
)

log = logging.getLogger("tandem.engine")

T = TypeVar("T")
R = TypeVar("R", bound=Runner)


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


class SchedulerEngine(AdapterHost, ABC, Generic[R]):
    """An engine whose ``runner`` the ``Scheduler`` drives; subclasses build the runner and
    load adapters onto it (``load_adapter_sync``/``unload_adapter_sync``)."""

    kind: str

    def __init__(
        self,
        runner: R,
        tokenizer: Any,
        *,
        name: str,
        eos_token_ids: set[int],
        vocab_size: int,
        max_batch_size: int,
        max_queue: int,
        prefill_chunk: int,
        request_timeout: float | None,
        num_threads: int,
        prefix_cache_mb: float,
        admit_window: float,
        tenant_max_queued: int | None,
        stall_after: float = defaults.STALL_S,
        prompt_lookup: PromptLookup | None = None,
    ) -> None:
        self.runner: R = runner
        self.tokenizer = tokenizer
        self.name = name
        self.request_timeout = request_timeout
        self.max_model_len = runner.max_len
        self.device = runner.device
        self.model_lock = threading.RLock()
        self.scheduler = Scheduler(
            runner,
            tokenizer,
            max_batch_size=max_batch_size,
            max_queue=max_queue,
            prefill_chunk=prefill_chunk,
            eos_token_ids=eos_token_ids,
            model_lock=self.model_lock,
            num_threads=num_threads,
            prefix_cache=PrefixCache(int(prefix_cache_mb * 2**20)),
            admit_window=admit_window,
            tenant_max_queued=tenant_max_queued,
            stall_after=stall_after,
            prompt_lookup=prompt_lookup,
        )
        # served adapter name -> where it was loaded from
        self.adapters: dict[str, str] = {}
        self._renders_tools: bool | None = None
        self._renders_calls: bool | None = None
        # the family's tool-call format: from the chat template's markers, else the model type
        # (a torch runner's config, llama.cpp's GGUF architecture)
        config = getattr(runner, "config", None)
        meta = getattr(runner, "meta", None)
        model_type = getattr(config, "model_type", None) or (meta("general.architecture") if meta else None)
        self.tool_format: ToolFormat
        self.tool_format, self.tool_format_reason = select_tool_format(
            model_type, getattr(tokenizer, "chat_template", None)
        )
        self.vocab_size = vocab_size
        self.guided = GuidedCompiler(tokenizer, vocab_size, eos_token_ids)

    # --- prompts -----------------------------------------------------------------------------------
    def encode_chat(
        self, messages: Iterable[PromptMessage | Mapping[str, Any]], tools: list[dict] | None = None
    ) -> list[int]:
        """The prompt of a chat request. Messages may also come as OpenAI's dicts (a dataset's,
        a benchmark's): they are read into ``PromptMessage`` here."""
        typed = [
            m if isinstance(m, PromptMessage) else PromptMessage.from_openai(m, i)
            for i, m in enumerate(messages)
        ]
        clean, extra = chat_template_input(
            typed, tools, self.template_renders_tools, self.tool_format, self.template_renders_calls
        )
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

    def template_renders_calls(self) -> bool:
        """Whether the chat template writes an assistant's ``tool_calls`` itself."""
        if self._renders_calls is None:
            self._renders_calls = template_renders_calls(self.tokenizer)
        return self._renders_calls

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
    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        """Around ``generate_batch``: what the model needs while it generates for the caller."""
        yield

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
        with self._generating():
            self.scheduler.submit(seqs, bounded=False)
            if self.scheduler.running:
                done.wait()
            else:
                self.scheduler.run_until_done()
        return [results[i] for i in range(total)]

    # --- the server's face (Engine protocol) ------------------------------------------------------
    async def start(self) -> None:
        log.info("tool-call format: %s: %s (%s)", self.name, self.tool_format.name, self.tool_format_reason)
        # ready the weights before serving, so the first request does not pay for it
        await in_own_thread(self.runner.prepare_weights)
        self.scheduler.start()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.scheduler.stop)

    async def health(self) -> dict[str, object]:
        """Through the scheduler: raises when its loop is dead or has left requests waiting
        past its stall bound (``Scheduler.check``), not only when the thread is gone."""
        return {
            "engine": self.kind,
            "model": self.name,
            "tool_format": self.tool_format.name,
            **self.scheduler.check(),
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

    @abstractmethod
    def load_adapter_sync(self, name: str, path: str) -> None:
        """Load the adapter at ``path`` onto the runner's model, served as ``name``."""

    @abstractmethod
    def unload_adapter_sync(self, name: str) -> None:
        """End the adapter's sequences and take it off the runner's model."""
