"""vLLM's async engine in process (GPU images, where ``vllm`` can be imported).

vLLM does the batching, paging and LoRA; this adapter turns its cumulative outputs into
``StreamEvent`` deltas and our ``SamplingParams`` into vLLM's. Not importable here means
the server refuses to start with ``TANDEM_INFERENCE_ENGINE=vllm`` (a clear message).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from services.inference.engine import tool_formats
from services.inference.engine.base import AdapterHost
from services.inference.engine.tools import (
    chat_template_input,
    template_renders_calls,
    template_renders_tools,
)
from services.inference.engine.types import (
    AdapterError,
    ContextLengthExceeded,
    EngineRequest,
    EngineUnavailable,
    GuidedDecoding,
    InvalidParams,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    TopLogprob,
)


def _structured_outputs(guided: GuidedDecoding) -> dict[str, Any]:
    """vLLM's own guided decoding for our grammar: ``StructuredOutputsParams`` (vLLM >= 0.10.2,
    what the GPU image's ``vllm/vllm-openai:latest`` carries), else the older
    ``GuidedDecodingParams``. Untested here (no GPU in CI)."""
    schema = json.loads(guided.json_schema) if guided.json_schema is not None else None
    try:
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(json=schema, grammar=guided.grammar)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(json=schema, grammar=guided.grammar)}


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(AdapterHost):
    kind = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        name: str,
        max_model_len: int,
        max_num_seqs: int,
        gpu_memory_utilization: float = 0.85,
        dtype: str = "auto",
        max_lora_rank: int = 64,
        max_loras: int = 8,
    ) -> None:
        if not vllm_available():
            raise EngineUnavailable(
                "TANDEM_INFERENCE_ENGINE=vllm needs the vllm package (the GPU image has it)"
            )
        self.model_path = model_path
        self.name = name
        self.max_model_len = max_model_len
        self._args = {
            "model": model_path,
            "served_model_name": name,
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "gpu_memory_utilization": gpu_memory_utilization,
            "dtype": dtype,
            "enable_lora": True,
            "max_loras": max_loras,
            "max_lora_rank": max_lora_rank,
        }
        # what /v1/capabilities reports: vLLM refuses adapters of a higher rank
        self.max_lora_rank = max_lora_rank
        self.engine: Any = None
        self.tokenizer: Any = None
        self.tool_format = tool_formats.DEFAULT
        self.adapters: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)

    async def start(self) -> None:
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        self.engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**self._args))
        self.tokenizer = await self.engine.get_tokenizer()
        hf_config = getattr(getattr(self.engine, "model_config", None), "hf_config", None)
        self.tool_format, _ = tool_formats.select(
            getattr(hf_config, "model_type", None), getattr(self.tokenizer, "chat_template", None)
        )

    async def shutdown(self) -> None:
        if self.engine is not None and hasattr(self.engine, "shutdown"):
            self.engine.shutdown()

    async def health(self) -> dict[str, object]:
        if self.engine is None:
            raise EngineUnavailable("vLLM is not started")
        await self.engine.check_health()
        return {"engine": self.kind, "model": self.name}

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def load_adapter(self, name: str, path: str) -> None:
        from vllm.lora.request import LoRARequest

        self.check_free(name)
        request = LoRARequest(name, next(self._lora_ids), path)
        try:
            await self.engine.add_lora(request)
        except Exception as exc:
            raise AdapterError(f"lora_path {path!r} could not be loaded: {exc}") from None
        self.adapters[name] = request

    async def unload_adapter(self, name: str) -> None:
        self.check_loaded(name)
        request = self.adapters.pop(name)
        with contextlib.suppress(Exception):
            await self.engine.remove_lora(request.lora_int_id)

    def _params(self, params: SamplingParams, max_tokens: int, seed: int | None) -> Any:
        from vllm import SamplingParams as VSP

        extra: dict[str, Any] = {}
        if params.guided is not None:
            extra = _structured_outputs(params.guided)
        return VSP(
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias) or None,
            min_p=params.min_p,
            **extra,
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=max_tokens,
            stop=params.stop or None,
            stop_token_ids=params.stop_token_ids or None,
            ignore_eos=params.ignore_eos,
            seed=seed,
            logprobs=params.logprobs,
            skip_special_tokens=params.skip_special_tokens,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        from vllm.inputs import TokensPrompt

        request.params.validate()
        request.params.check_vocab(len(self.tokenizer))
        if request.echo or request.suffix is not None:
            param = "echo" if request.echo else "suffix"
            raise InvalidParams(f"{param} is not supported on the vLLM engine", param)
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.messages is not None:
            messages, extra = chat_template_input(
                request.messages,
                request.tools,
                lambda: template_renders_tools(self.tokenizer),
                self.tool_format,
                lambda: template_renders_calls(self.tokenizer),
            )
            try:
                ids = list(
                    self.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True, tokenize=True, **extra
                    )
                )
            except Exception as exc:
                raise InvalidParams(f"the chat template rejected the messages: {exc}", "messages") from None
        else:
            ids = list(self.tokenizer(request.prompt or "")["input_ids"])
        room = self.max_model_len - len(ids)
        if room <= 0 or (request.params.max_tokens is not None and request.params.max_tokens > room):
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + (request.params.max_tokens or 0)} tokens ({len(ids)} in the prompt).",
                self.max_model_len,
            )
        max_tokens = request.params.max_tokens or room
        lora = self.adapters.get(request.model or "")
        queue: asyncio.Queue[StreamEvent | None] = asyncio.Queue()
        n = request.params.n

        async def run(j: int) -> None:
            seed = None if request.params.seed is None else request.params.seed + j
            rid = f"{request.request_id}-{j}"
            sent_text, sent_tokens = 0, 0
            try:
                async for out in self.engine.generate(
                    TokensPrompt(prompt_token_ids=ids),
                    self._params(request.params, max_tokens, seed),
                    rid,
                    lora_request=lora,
                ):
                    comp = out.outputs[0]
                    new_ids = list(comp.token_ids[sent_tokens:])
                    entries = None
                    if request.params.logprobs is not None and comp.logprobs:
                        entries = []
                        for tid, lps in zip(new_ids, comp.logprobs[sent_tokens:], strict=False):
                            top = sorted(lps.items(), key=lambda kv: -kv[1].logprob)[
                                : request.params.logprobs
                            ]
                            entries.append(
                                TokenLogprob(
                                    tid,
                                    lps[tid].decoded_token or "",
                                    lps[tid].logprob,
                                    [TopLogprob(t, v.decoded_token or "", v.logprob) for t, v in top],
                                )
                            )
                    text = comp.text[sent_text:]
                    sent_text, sent_tokens = len(comp.text), len(comp.token_ids)
                    reason = comp.finish_reason if out.finished else None
                    await queue.put(StreamEvent(j, new_ids, text, entries, reason, len(ids), sent_tokens))  # type: ignore[arg-type]
            except asyncio.CancelledError:
                await self.engine.abort(rid)
                raise
            except Exception as exc:  # vLLM's engine loop died (EngineDeadError) or failed this request
                error = f"generation failed: {type(exc).__name__}: {exc}"
                await queue.put(StreamEvent(j, [], "", None, "error", len(ids), sent_tokens, error=error))
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(run(j)) for j in range(n)]

        async def stream() -> AsyncIterator[StreamEvent]:
            open_tasks = n
            try:
                while open_tasks:
                    ev = await queue.get()
                    if ev is None:
                        open_tasks -= 1
                    else:
                        yield ev
            finally:
                for task in tasks:
                    task.cancel()

        return stream()
