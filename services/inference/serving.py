"""OpenAI-compatible chat and text completions over any ``Engine``.

Builds the response bodies and SSE chunks exactly as OpenAI's API does
(``chat.completion`` / ``chat.completion.chunk`` / ``text_completion``, ``data: [DONE]``
at the end, usage in a last chunk with ``choices: []`` when
``stream_options.include_usage`` is set), and maps engine errors to HTTP errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from services.common.auth import acting_principal
from services.common.errors import (
    Conflict,
    ErrorJson,
    Forbidden,
    InvalidRequest,
    NotFound,
    ServiceUnavailable,
    TandemError,
    TooManyRequests,
    UpstreamError,
    error_body,
)
from services.common.model_restrictions import ModelRestrictions
from services.common.openai_wire import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    FunctionDelta,
    TextCompletion,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from services.inference.engine.base import AdapterNotFound, NameTaken
from services.inference.engine.tool_formats import DEFAULT as DEFAULT_TOOL_FORMAT
from services.inference.engine.tool_formats import ToolFormat, tool_names
from services.inference.engine.tools import call_schema
from services.inference.engine.types import (
    AdapterError,
    ContextLengthExceeded,
    EngineError,
    EngineRequest,
    EngineUnavailable,
    GuidedDecoding,
    InvalidParams,
    PromptMessage,
    QueueFull,
    SamplingParams,
    StreamEvent,
    TokenLogprob,
    UnknownModel,
    UpstreamFailure,
)
from services.inference.metrics import observed
from services.inference.protocol import ChatCompletionRequest, CompletionRequest
from services.inference.registry import ModelRegistry, NotPermitted

log = logging.getLogger("tandem.inference.serving")


class GatewayTimeout(TandemError):
    status_code = 504
    type = "timeout_error"


def http_error(exc: EngineError) -> TandemError:
    """The one place engine errors become HTTP errors (OpenAI's error shape)."""
    if isinstance(exc, ContextLengthExceeded):
        return InvalidRequest(str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidParams):
        return InvalidRequest(str(exc), param=exc.param)
    if isinstance(exc, QueueFull):
        return TooManyRequests(
            str(exc), code=exc.code, headers={"Retry-After": str(max(1, round(exc.retry_after)))}
        )
    if isinstance(exc, NameTaken):
        return Conflict(str(exc))
    if isinstance(exc, AdapterNotFound):
        return NotFound(str(exc), param="lora_name", code="adapter_not_found")
    if isinstance(exc, UnknownModel):
        return NotFound(str(exc), param="model", code="model_not_found")
    if isinstance(exc, NotPermitted):
        return Forbidden(str(exc), code="forbidden")
    if isinstance(exc, AdapterError):
        return InvalidRequest(str(exc), param="lora_path")
    if isinstance(exc, EngineUnavailable):
        return ServiceUnavailable(str(exc))
    if isinstance(exc, UpstreamFailure):
        upstream = (exc.body or {}).get("error") if isinstance(exc.body, dict) else None
        message = (
            str(upstream.get("message"))
            if isinstance(upstream, dict) and upstream.get("message")
            else str(exc)
        )
        if 400 <= exc.status_code < 500:
            cls = {404: NotFound, 409: Conflict, 429: TooManyRequests}.get(exc.status_code, InvalidRequest)
            err = cls(message)
            err.status_code = exc.status_code
            return err
        return UpstreamError(message)
    return InvalidRequest(str(exc))


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 16:
        raise InvalidRequest(f"stop: at most 16 stop strings, got {len(stops)}", param="stop")
    if any(not s for s in stops):
        raise InvalidRequest("stop: stop strings must not be empty", param="stop")
    return stops


def _check_schema(schema: Any, param: str) -> None:
    """A schema that is not valid JSON Schema is the client's error, named by ``param``."""
    import jsonschema

    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(
            f"{param} must be a JSON Schema object, got {type(schema).__name__}", param=param
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(f"{param} is not a valid JSON Schema: {exc.message}", param=param) from None


def guided_decoding(req: ChatCompletionRequest | CompletionRequest) -> GuidedDecoding | None:
    """``response_format`` (json_object / json_schema) or vLLM's ``guided_grammar`` as a grammar."""
    rf = req.response_format
    guided: GuidedDecoding | None = None
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            guided = GuidedDecoding(json_schema=json.dumps({"type": "object"}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise InvalidRequest(
                    "response_format.json_schema must be an object with name and schema",
                    param="response_format.json_schema",
                )
            name = spec.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
                raise InvalidRequest(
                    f"response_format.json_schema.name must be 1-64 letters, digits, _ or -, got {name!r}",
                    param="response_format.json_schema.name",
                )
            schema = spec.get("schema", {})
            _check_schema(schema, "response_format.json_schema.schema")
            guided = GuidedDecoding(
                json_schema=json.dumps(schema), param="response_format.json_schema.schema"
            )
        elif kind not in (None, "text"):
            raise InvalidRequest(
                f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                param="response_format.type",
            )
    if req.guided_grammar is not None:
        if guided is not None:
            raise InvalidRequest("give response_format or guided_grammar, not both", param="guided_grammar")
        guided = GuidedDecoding(grammar=req.guided_grammar, param="guided_grammar")
    return guided


@dataclass
class ToolPlan:
    """What a chat request asks of tools: ``mode`` none/auto/required/named; ``format``: the
    serving engine's model family's tool-call format (known once an engine is leased)."""

    tools: list[dict[str, Any]]
    mode: str
    name: str | None = None
    parallel: bool = True
    format: ToolFormat = DEFAULT_TOOL_FORMAT

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def tool_plan(req: ChatCompletionRequest) -> ToolPlan:
    tools, choice = req.tools or [], req.tool_choice
    parallel = req.parallel_tool_calls is not False
    names: list[str] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidRequest(f"tools[{i}].type must be 'function'", param=f"tools[{i}].type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(f"tools[{i}].function must be an object", param=f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise InvalidRequest(
                f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                param=f"tools[{i}].function.name",
            )
        if name in names:
            raise InvalidRequest(
                f"tools[{i}].function.name {name!r} is repeated", param=f"tools[{i}].function.name"
            )
        names.append(name)
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"tools[{i}].function.parameters")
    if choice is None:
        return ToolPlan(tools, "auto" if tools else "none", parallel=parallel)
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return ToolPlan(tools, choice if tools else "none", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        name = (
            (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        )
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not among the tools {names}",
                param="tool_choice",
            )
        return ToolPlan(tools, "named", name=name, parallel=False)
    raise InvalidRequest(
        f"tool_choice must be none, auto, required or {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
        param="tool_choice",
    )


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            out[int(key)] = float(value)
        except (TypeError, ValueError):
            raise InvalidRequest(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
    return out


def sampling_params(req: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens or req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens
        logprobs = req.logprobs
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        max_tokens=max_tokens,
        stop=_stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        n=req.n,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req.logit_bias),
        min_p=req.min_p or 0.0,
        guided=guided_decoding(req),
    )
    try:
        params.validate()
    except InvalidParams as exc:
        raise http_error(exc) from None
    return params


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(entries: list[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=_token_bytes(e.token),
                top_logprobs=[
                    TopLogprob(token=t.token, logprob=t.logprob, bytes=_token_bytes(t.token)) for t in e.top
                ],
            )
            for e in entries
        ]
    )


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[e.logprob for e in entries],
        # logprobs=0 still reports the sampled token (OpenAI's way), not an empty entry
        top_logprobs=[{t.token: t.logprob for t in e.top} or {e.token: e.logprob} for e in entries],
        text_offset=offsets,
    )


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chars: int = 0
    # calls an upstream parsed itself (remote engine), merged from its deltas by index
    upstream_calls: dict[int, dict[str, str]] = field(default_factory=dict)

    def count(self, ev: StreamEvent) -> None:
        self.prompt_tokens = ev.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, ev.completion_tokens)

    def add_call_deltas(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            slot = self.upstream_calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] = d.id or slot["id"]
            if d.function is not None:
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""

    def answer(self, plan: ToolPlan) -> tuple[str | None, list[ToolCall] | None]:
        """The message's content and calls: an upstream's own calls, or those parsed from the
        text in the model family's format (the text before them is the content)."""
        text = "".join(self.text)
        if self.upstream_calls:
            calls = [
                ToolCall.of(c["name"], c["arguments"], c["id"])
                for _, c in sorted(self.upstream_calls.items())
            ]
            return None, calls
        found = plan.format.parse(text, plan.tools) if plan.active else None
        if found is None:
            return text, None
        return found.content.strip() or None, found.calls


def _sse(payload: BaseModel | ErrorJson) -> str:
    # json.dumps of the dump, not pydantic's own JSON: the bytes (separators, float digits)
    # stay those clients have always been sent
    data = payload.model_dump() if isinstance(payload, BaseModel) else payload
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _tool_call_deltas(raw: list[dict[str, Any]]) -> list[ToolCallDelta]:
    """An upstream's own call deltas (remote engine), already in OpenAI's chunk shape."""
    return [ToolCallDelta.model_validate(d) for d in raw]


ChoiceT = TypeVar("ChoiceT", ChatChunkChoice, CompletionChoice)


@dataclass
class _Chunks(Generic[ChoiceT]):
    """What every chunk of one streamed response shares; ``make`` builds one chunk."""

    # ChatCompletionChunk or TextCompletion, whose choices are ChoiceT
    cls: Callable[..., ChatCompletionChunk | TextCompletion]
    id: str
    created: int
    model: str
    include_usage: bool

    def make(self, choices: list[ChoiceT], usage: Usage | None = None) -> str:
        fields: dict[str, Usage | None] = {"usage": usage} if self.include_usage else {}
        return _sse(self.cls(id=self.id, created=self.created, model=self.model, choices=choices, **fields))


FAILED = ("timeout", "error", "abort")


def _usage(choices: list[_Choice], n: int) -> Usage:
    # the prompt counts once per prompt, however many choices it has (OpenAI's way)
    prompt = sum(c.prompt_tokens for i, c in enumerate(choices) if i % n == 0)
    completion = sum(c.completion_tokens for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _stream_error(ev: StreamEvent) -> ErrorJson:
    if ev.finish_reason == "timeout":
        return error_body("timeout_error", ev.error or "the request timed out", None, "timeout")
    return error_body("internal_error", ev.error or "generation was interrupted", None, ev.finish_reason)


async def _stream(
    events: AsyncIterator[StreamEvent],
    total: int,
    n: int,
    chunks: _Chunks[ChoiceT],
    step: Callable[[StreamEvent, _Choice], Iterator[list[ChoiceT]]],
    first: list[list[ChoiceT]] | None = None,
) -> AsyncIterator[str]:
    """The SSE stream of chat and text completions alike: ``first`` chunks, then the chunks
    ``step`` makes of each engine event, an error event if generation failed, the usage chunk
    (``choices: []``) when asked for, and ``[DONE]``.

    However the engine fails (an error event of its own, its stream raising, its stream ending
    before every choice finished: an engine loop that died), the client reads an error event
    and ``[DONE]``, never a connection closed mid-stream (a transport error to the client) nor
    an answer cut short that looks complete."""
    for choices in first or []:
        yield chunks.make(choices)
    state = [_Choice() for _ in range(total)]
    failure: ErrorJson | None = None
    try:
        async for ev in events:
            c = state[ev.index]
            c.count(ev)
            if ev.error is not None or ev.finish_reason in FAILED:
                failure = _stream_error(ev)
                break
            for choices in step(ev, c):
                yield chunks.make(choices)
            if ev.finish_reason is not None:
                c.finish_reason = c.finish_reason or ev.finish_reason
    except Exception as exc:  # cancellation (the client left) is a BaseException: it goes on
        log.exception("the engine's stream failed")
        failure = error_body(
            "internal_error", f"generation failed: {type(exc).__name__}: {exc}", None, "error"
        )
    if failure is None and any(c.finish_reason is None for c in state):
        failure = error_body(
            "internal_error", "the engine's stream ended before the answer was complete", None, "error"
        )
    if failure is not None:
        yield _sse(failure)
    elif chunks.include_usage:
        yield chunks.make([], _usage(state, n))
    yield "data: [DONE]\n\n"


def _tool_call_chunks(index: int, calls: list[ToolCall]) -> list[ChatChunkChoice]:
    """OpenAI's streamed tool-call deltas: per call, one chunk with its index, id, type and
    name (arguments empty), then the arguments in fragments."""
    out: list[ChatChunkChoice] = []
    for k, call in enumerate(calls):
        arguments = call.function.arguments
        pieces = [
            ToolCallDelta(
                index=k,
                id=call.id,
                type="function",
                function=FunctionDelta(name=call.function.name, arguments=""),
            )
        ] + [
            ToolCallDelta(index=k, function=FunctionDelta(arguments=arguments[start : start + 32]))
            for start in range(0, len(arguments), 32)
        ]
        out += [ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[piece])) for piece in pieces]
    return out


async def _merge(streams: list[tuple[int, AsyncIterator[StreamEvent]]]) -> AsyncIterator[StreamEvent]:
    """Events of several engine streams (one per completions prompt), choice indices offset."""
    if len(streams) == 1:
        offset, only = streams[0]
        async for ev in only:
            ev.index += offset
            yield ev
        return
    queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue()

    async def pump(offset: int, stream: AsyncIterator[StreamEvent]) -> None:
        try:
            async for ev in stream:
                ev.index += offset
                await queue.put(ev)
        except BaseException as exc:
            await queue.put(exc)
            raise
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(o, s)) for o, s in streams]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for (_, stream), task in zip(streams, tasks, strict=True):
            with contextlib.suppress(BaseException):
                await task
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


class OpenAIServing:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def _open(
        self, requests: list[EngineRequest], model: str, n: int, raw: Request, tools: ToolPlan | None = None
    ) -> AsyncIterator[StreamEvent]:
        """The merged stream of ``requests`` on the engine serving ``model``; ``tools`` learns
        that engine's tool-call format."""
        try:
            # an operator acting for a tenant (the trainer's worker) is that tenant here
            principal = acting_principal(raw)
            if model != self.registry.base_name:
                # a fine-tune from feedback on collections the caller may not read: as the agent does
                await ModelRestrictions(raw.app.state.redis).check_named(principal, model, "model")
            lease = await self.registry.acquire(model, principal)
            if tools is not None:
                tools.format = getattr(lease.engine, "tool_format", DEFAULT_TOOL_FORMAT)
            streams: list[tuple[int, AsyncIterator[StreamEvent]]] = []
            try:
                for i, req in enumerate(requests):
                    req.tenant = principal.tenant
                    # Tokenise off the event loop (an 8 MB message takes seconds); the engine
                    # then takes the ids as they are.
                    encode = getattr(lease.engine, "prompt_ids", None)
                    if encode is not None and req.prompt_token_ids is None:
                        req.prompt_token_ids = await asyncio.to_thread(encode, req)
                    streams.append((i * n, await lease.engine.generate(req)))
            except BaseException:
                lease.release()
                for _, s in streams:
                    aclose = getattr(s, "aclose", None)
                    if aclose is not None:
                        await aclose()
                raise
        except EngineError as exc:
            raise http_error(exc) from None
        # the adapter counts as running until the merged stream ends or is closed
        return lease.wrap(
            observed(
                _merge(streams),
                getattr(raw.app.state, "engine_metrics", None),
                model=model,
                adapter="" if model == self.registry.base_name else model,
                tenant=principal.tenant,
                n=n,
            )
        )

    # --- chat ---------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        plan = tool_plan(req)
        params = sampling_params(req)
        if plan.forced:
            # the output is forced into the call format, arguments valid against their schema
            params.guided = GuidedDecoding(
                json_schema=json.dumps(call_schema(plan.tools, plan.name, plan.parallel)), param="tools"
            )
        # read as any library caller's are (the wire model has checked their shapes: a non-text
        # part is refused by an engine that renders the prompt, a remote one forwards it)
        messages = [
            PromptMessage.from_openai(
                m.model_dump(
                    exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"}
                ),
                i,
            )
            for i, m in enumerate(req.messages)
        ]
        body = req.model_dump(exclude_unset=True)
        engine_req = EngineRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            params=params,
            model=req.model,
            messages=messages,
            # rendered with tool_choice none too (as OpenAI does): the history may refer to them
            tools=plan.tools or None,
            extra=body,
        )
        stream = await self._open([engine_req], req.model, req.n, raw, plan)
        created = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            first, step = self._chat_steps(params, plan, req.n)
            chunks = _Chunks[ChatChunkChoice](
                ChatCompletionChunk, engine_req.request_id, created, req.model, include_usage
            )
            return self._sse_response(_stream(stream, req.n, req.n, chunks, step, first), raw)
        choices = await self._collect(stream, raw, req.n)
        out_choices = []
        for i, c in enumerate(choices):
            content, calls = c.answer(plan)
            out_choices.append(
                ChatChoice(
                    index=i,
                    message=ChatCompletionMessage(content=content, tool_calls=calls),
                    logprobs=chat_logprobs(c.logprobs) if params.logprobs is not None else None,
                    finish_reason="tool_calls" if calls else c.finish_reason,
                )
            )
        body_out = ChatCompletion(
            id=engine_req.request_id,
            created=created,
            model=req.model,
            choices=out_choices,
            usage=_usage(choices, req.n),
        )
        return JSONResponse(body_out.model_dump())

    @staticmethod
    def _chat_steps(
        params: SamplingParams, plan: ToolPlan, n: int
    ) -> tuple[
        list[list[ChatChunkChoice]], Callable[[StreamEvent, _Choice], Iterator[list[ChatChunkChoice]]]
    ]:
        """The first chunks (each choice's role) and the chunks each event becomes. With tools,
        text that may be a call (in the model family's format) is held back until it can be
        told apart; the content before a call streams as it comes."""
        first = [[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))] for i in range(n)]
        names = tool_names(plan.tools)
        sent = [0] * n  # characters of each choice's text streamed as content
        pending: list[list[TokenLogprob]] = [[] for _ in range(n)]  # their entries not yet sent

        def content(index: int, text: str, entries: list[TokenLogprob] | None) -> list[ChatChunkChoice]:
            lp = chat_logprobs(entries) if (params.logprobs is not None and entries) else None
            return [ChatChunkChoice(index=index, delta=ChatDelta(content=text), logprobs=lp)]

        def finish(index: int, reason: str) -> list[ChatChunkChoice]:
            return [ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=reason)]

        def release(index: int, text: str) -> list[ChatChunkChoice]:
            sent[index] += len(text)
            entries, pending[index] = pending[index], []
            return content(index, text, entries)

        def held(ev: StreamEvent, c: _Choice) -> Iterator[list[ChatChunkChoice]]:
            c.text.append(ev.text)
            pending[ev.index].extend(ev.logprobs or [])
            text, done = "".join(c.text), sent[ev.index]
            if not plan.forced:
                cut = plan.format.content_end(text[done:], done == 0, names)
                if cut:
                    yield release(ev.index, text[done : done + cut])
            if ev.finish_reason is None:
                return
            found = None if c.upstream_calls else plan.format.parse(text, plan.tools)
            if found is None:
                if text[sent[ev.index] :] or pending[ev.index]:
                    yield release(ev.index, text[sent[ev.index] :])
                return
            if found.content[sent[ev.index] :].strip():
                yield release(ev.index, found.content[sent[ev.index] :])
            for piece in _tool_call_chunks(ev.index, found.calls):
                yield [piece]
            c.finish_reason = "tool_calls"

        def step(ev: StreamEvent, c: _Choice) -> Iterator[list[ChatChunkChoice]]:
            if ev.tool_calls:
                deltas = _tool_call_deltas(ev.tool_calls)
                c.add_call_deltas(deltas)
                yield [ChatChunkChoice(index=ev.index, delta=ChatDelta(tool_calls=deltas))]
            if plan.active:
                yield from held(ev, c)
                if c.finish_reason == "tool_calls":
                    yield finish(ev.index, "tool_calls")
                    return
            elif ev.text or (ev.logprobs and params.logprobs is not None):
                yield content(ev.index, ev.text, ev.logprobs)
            if ev.finish_reason is not None:
                c.finish_reason = ev.finish_reason
                yield finish(ev.index, ev.finish_reason)

        return first, step

    # --- completions -------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        if req.echo and req.logprobs is not None:
            # the prompt's own log-probabilities are not computed by the engines yet
            raise InvalidRequest("echo with logprobs is not supported by this server", param="echo")
        if req.echo and req.suffix is not None:
            raise InvalidRequest("echo and suffix cannot be combined", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequest(
                f"best_of must equal n ({req.n}) on this server, got {req.best_of}", param="best_of"
            )
        params = sampling_params(req)
        prompts: list[str | list[int]]
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        elif (p and all(isinstance(x, str) for x in p)) or (p and all(isinstance(x, list) for x in p)):
            prompts = list(p)  # type: ignore[arg-type]
        else:
            raise InvalidRequest(
                "prompt must be a string, a list of strings or of token ids, and not empty", param="prompt"
            )
        if len(prompts) * req.n > 64:
            raise InvalidRequest(
                f"at most 64 choices per request, got {len(prompts) * req.n}", param="prompt"
            )
        rid = f"cmpl-{uuid.uuid4().hex}"
        body = req.model_dump(exclude_unset=True)
        engine_reqs = [
            EngineRequest(
                request_id=f"{rid}-{i}",
                params=params,
                model=req.model,
                prompt=q if isinstance(q, str) else None,
                prompt_token_ids=q if isinstance(q, list) else None,
                echo=req.echo,
                suffix=req.suffix,
                extra={**body, "prompt": q},
            )
            for i, q in enumerate(prompts)
        ]
        stream = await self._open(engine_reqs, req.model, req.n, raw)
        created = int(time.time())
        total = len(prompts) * req.n
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = _Chunks[CompletionChoice](TextCompletion, rid, created, req.model, include_usage)
            return self._sse_response(
                _stream(stream, total, req.n, chunks, self._completion_step(params)), raw
            )
        choices = await self._collect(stream, raw, total)
        body_out = TextCompletion(
            id=rid,
            created=created,
            model=req.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text="".join(c.text),
                    logprobs=completion_logprobs(c.logprobs, 0) if params.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=_usage(choices, req.n),
        )
        return JSONResponse(body_out.model_dump())

    @staticmethod
    def _completion_step(
        params: SamplingParams,
    ) -> Callable[[StreamEvent, _Choice], Iterator[list[CompletionChoice]]]:
        def step(ev: StreamEvent, c: _Choice) -> Iterator[list[CompletionChoice]]:
            lp = None
            if params.logprobs is not None and ev.logprobs:
                lp = completion_logprobs(ev.logprobs, c.chars)
            c.chars += len(ev.text)
            if ev.text or lp is not None or ev.finish_reason is not None:
                yield [
                    CompletionChoice(
                        index=ev.index, text=ev.text, logprobs=lp, finish_reason=ev.finish_reason
                    )
                ]

        return step

    # --- shared ---------------------------------------------------------------------------------

    @staticmethod
    def _sse_response(chunks: AsyncIterator[str], raw: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            # closing the chunk generator closes the engine stream, which aborts the request:
            # Starlette cancels this when the client disconnects, so the slot is freed at once
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for piece in chunks:
                    yield piece

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _collect(self, stream: AsyncIterator[StreamEvent], raw: Request, total: int) -> list[_Choice]:
        choices = [_Choice() for _ in range(total)]

        async def consume() -> None:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for ev in stream:
                    c = choices[ev.index]
                    if ev.finish_reason == "timeout":
                        raise GatewayTimeout(ev.error or "the request timed out", code="timeout")
                    if ev.finish_reason in ("error", "abort"):
                        raise ServiceUnavailable(ev.error or "generation was interrupted")
                    c.text.append(ev.text)
                    if ev.logprobs:
                        c.logprobs.extend(ev.logprobs)
                    if ev.tool_calls:
                        c.add_call_deltas(_tool_call_deltas(ev.tool_calls))
                    c.count(ev)
                    if ev.finish_reason is not None:
                        c.finish_reason = ev.finish_reason

        await _until_disconnect(consume(), raw)
        return choices


async def _until_disconnect(work: Awaitable[None], raw: Request) -> None:
    """Run ``work``; if the client disconnects first, cancel it (which aborts the request)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await raw.is_disconnected():
            await asyncio.sleep(0.25)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.done() and not task.cancelled():
        task.result()


Handler = Callable[..., Awaitable[Any]]
