"""Forwards generation to any OpenAI-compatible server (vLLM, TGI, Ollama, another Tandem).

Requests go upstream as streams (``stream: true`` with usage), whatever the client
asked, so this service can stream to its own clients and count tokens; closing the
stream closes the upstream connection, which makes the upstream server abort too.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

import httpx

from services.common.openai_client import OpenAIClient
from services.common.openai_wire import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionLogprobs,
    ModelList,
    TextCompletion,
)
from services.common.replicas import api_root
from services.common.upstream import UpstreamBroken, UpstreamFailed, UpstreamStatus
from services.inference.engine.base import AdapterNotFound, NameTaken, ServedModel
from services.inference.engine.types import (
    AdapterError,
    EngineRequest,
    FinishReason,
    InvalidParams,
    StreamEvent,
    TokenLogprob,
    TopLogprob,
    UpstreamFailure,
)

# Fields this service interprets itself and never forwards as they came.
_OWN = {"stream", "stream_options"}


def _from_request(request: EngineRequest) -> dict[str, Any]:
    """The OpenAI request body of ``request``'s own fields (the defaults left out)."""
    p = request.params
    body: dict[str, Any] = {"temperature": p.temperature, "top_p": p.top_p}
    if request.messages is not None:
        body["messages"] = [m.openai() for m in request.messages]
    elif request.prompt is not None:
        body["prompt"] = request.prompt
    optional: dict[str, Any] = {
        "max_tokens": p.max_tokens,
        "top_k": p.top_k or None,
        "stop": p.stop or None,
        "stop_token_ids": p.stop_token_ids or None,
        "ignore_eos": p.ignore_eos or None,
        "seed": p.seed,
        "n": p.n if p.n != 1 else None,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        "min_p": p.min_p or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


class RemoteEngine:
    kind = "remote"

    def __init__(
        self, base_url: str, *, api_key: str = "", timeout: float = 300.0, structured_outputs: bool = True
    ) -> None:
        # whether the upstream honours response_format / guided_grammar (vLLM, OpenAI do):
        # when it does not, such requests are refused here rather than silently unconstrained
        self.structured_outputs = structured_outputs
        self.base = api_root(base_url.rstrip("/"))
        self.api = OpenAIClient(
            self.base,
            api_key,
            service="upstream",
            timeout=httpx.Timeout(timeout, connect=10.0),
            persistent=True,
        )
        self._names: set[str] = set()

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        await self.api.aclose()

    def _failure(self, exc: UpstreamFailed | httpx.HTTPError) -> UpstreamFailure:
        if isinstance(exc, UpstreamStatus):
            reply = exc.reply
            body = reply.body or {"error": {"message": reply.message}}
            return UpstreamFailure(f"upstream answered {reply.status_code}", reply.status_code, body)
        if isinstance(exc, UpstreamBroken):
            return UpstreamFailure(f"{self.base}: {exc}")
        return UpstreamFailure(f"{self.base} is unreachable: {exc}")

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            return await self.api.request(method, path, body, idempotent=method == "GET")
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise self._failure(exc) from None

    async def models(self) -> list[ServedModel]:
        try:
            listed = await self.api.request_as(ModelList, "GET", "/models")
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise self._failure(exc) from None
        out = []
        for m in listed.data:
            if m.kind in ("embedding", "rerank"):  # an upstream Tandem's: not chat models
                continue
            kind = "adapter" if m.parent else "base"
            out.append(ServedModel(m.id, kind, parent=m.parent, max_model_len=m.max_model_len))
        self._names = {m.id for m in out}
        return out

    def serves(self, model: str) -> bool:
        # the upstream decides (an unknown name comes back as its 404)
        return True

    async def health(self) -> dict[str, object]:
        await self.models()
        return {"engine": self.kind, "upstream": self.base}

    async def abort(self, request_id: str) -> None:
        # closing the stream (the consumer does) is the abort
        return None

    async def load_adapter(self, name: str, path: str) -> None:
        try:
            await self._json("POST", "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        except UpstreamFailure as exc:
            raise (
                NameTaken(name, _message(exc)) if exc.status_code == 409 else AdapterError(_message(exc))
            ) from None

    async def unload_adapter(self, name: str) -> None:
        try:
            await self._json("POST", "/unload_lora_adapter", {"lora_name": name})
        except UpstreamFailure as exc:
            raise AdapterNotFound(
                name, f"no adapter named {name!r} is loaded upstream: {_message(exc)}"
            ) from None

    async def generate(self, request: EngineRequest) -> AsyncIterator[StreamEvent]:
        chat = request.messages is not None
        guided = request.params.guided
        # a forced tool call's grammar (param "tools") is the upstream's business: it gets
        # tools and tool_choice as sent, and its tool_calls come back as they are
        if guided is not None and guided.param != "tools" and not self.structured_outputs:
            raise InvalidParams(
                f"{guided.param}: the remote engine's upstream does not support structured output "
                "(TANDEM_INFERENCE_REMOTE_STRUCTURED_OUTPUTS=false)",
                guided.param,
            )
        # The client's own body (request.extra) is forwarded as sent, so fields this engine does
        # not model reach the upstream; a request built without one (a rollout, a benchmark)
        # still carries its prompt and sampling parameters.
        body = {**_from_request(request), **{k: v for k, v in request.extra.items() if k not in _OWN}}
        body.update(stream=True, stream_options={"include_usage": True})
        if request.model:
            body["model"] = request.model
        if request.prompt_token_ids is not None and not chat:
            body["prompt"] = request.prompt_token_ids
        path = "/chat/completions" if chat else "/completions"
        chunks: AsyncGenerator[ChatCompletionChunk | TextCompletion, None] = (
            self.api.stream(path, body, ChatCompletionChunk)
            if chat
            else self.api.stream(path, body, TextCompletion)
        )
        # the first chunk with output is awaited here, so a refused request is this call's error
        # (an HTTP status for the client) rather than an error inside a started stream
        try:
            first = await anext(chunks, None)
        except UpstreamBroken as exc:
            return _failed(str(exc))
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise self._failure(exc) from None
        return self._events(first, chunks, request.params.n)

    async def _events(
        self,
        first: ChatCompletionChunk | TextCompletion | None,
        chunks: AsyncGenerator[ChatCompletionChunk | TextCompletion, None],
        n: int,
    ) -> AsyncIterator[StreamEvent]:
        counts: dict[int, int] = {}
        finished: dict[int, StreamEvent] = {}
        usage = None
        try:
            chunk = first
            while chunk is not None:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    idx = choice.index
                    entries = _logprobs(choice.logprobs)
                    calls = (
                        [c.model_dump(exclude_none=True) for c in choice.delta.tool_calls or []]
                        if isinstance(choice, ChatChunkChoice)
                        else None
                    )
                    if choice.text or entries or calls:
                        counts[idx] = counts.get(idx, 0) + max(1, len(entries or []))
                        yield StreamEvent(
                            idx, [], choice.text, entries, None, 0, counts[idx], tool_calls=calls or None
                        )
                    if choice.finish_reason:
                        # held back until usage arrives, so the counts are the upstream's
                        # passed on as the upstream said it ("tool_calls" included)
                        reason = cast(FinishReason, choice.finish_reason)
                        finished[idx] = StreamEvent(idx, [], "", None, reason, 0, counts.get(idx, 0))
                chunk = await anext(chunks, None)
        except (UpstreamFailed, httpx.HTTPError) as exc:
            # an error object in the stream, or the connection lost after the first token
            yield StreamEvent(0, [], "", None, "error", 0, 0, error=str(exc) or type(exc).__name__)
            return
        finally:
            await chunks.aclose()
        per_prompt = usage.prompt_tokens if usage else 0
        completion = usage.completion_tokens if usage else 0
        for idx in sorted(finished):
            ev = finished[idx]
            ev.prompt_tokens = per_prompt
            if usage and len(finished) == 1:
                ev.completion_tokens = completion
            yield ev
        for idx in range(n):
            if idx not in finished:
                yield StreamEvent(
                    idx,
                    [],
                    "",
                    None,
                    "error",
                    per_prompt,
                    counts.get(idx, 0),
                    error="upstream stream ended early",
                )


async def _failed(message: str) -> AsyncIterator[StreamEvent]:
    yield StreamEvent(0, [], "", None, "error", 0, 0, error=message)


def _message(exc: UpstreamFailure) -> str:
    err = (exc.body or {}).get("error") if isinstance(exc.body, dict) else None
    return str(err.get("message")) if isinstance(err, dict) else str(exc)


def _logprobs(raw: ChatLogprobs | CompletionLogprobs | None) -> list[TokenLogprob] | None:
    if raw is None:
        return None
    if isinstance(raw, ChatLogprobs):
        return [
            TokenLogprob(-1, e.token, e.logprob, [TopLogprob(-1, t.token, t.logprob) for t in e.top_logprobs])
            for e in raw.content or []
        ] or None
    tops = raw.top_logprobs or [None] * len(raw.tokens)
    return [
        TokenLogprob(-1, tok, lp, [TopLogprob(-1, k, v) for k, v in (top or {}).items()])
        for tok, lp, top in zip(raw.tokens, raw.token_logprobs, tops, strict=False)
    ] or None
