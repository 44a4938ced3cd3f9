"""OpenAI's Responses API over the chat-completions path: a ``POST /v1/responses`` request is
read into a chat completion request (services/common/responses_input.py) and answered by
``OpenAIServing.chat`` (the same engine call, tool-call parsing and grammar-constrained output),
whose answer or SSE chunks become the ``response`` object or its typed events
(services/common/responses_stream.py).

``store`` (the default) keeps the response per tenant (services/common/response_store.py) for
``GET``/``DELETE /v1/responses/{id}`` and for ``previous_response_id``, which puts the stored
conversation before the new input.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.auth import acting_principal
from services.common.chat_messages import ChatMessage
from services.common.errors import InvalidRequest, TandemError
from services.common.response_store import ResponseStore
from services.common.responses_input import (
    chat_request,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
    rename_error,
)
from services.common.responses_stream import ResponseAssembly
from services.common.responses_wire import ResponseObject, ResponseRequest
from services.inference.protocol import ChatCompletionRequest
from services.inference.serving import OpenAIServing

# Tandem/vLLM sampling extensions a Responses request may carry too (as on chat completions)
_PASSED_ON = (
    "seed",
    "top_k",
    "stop",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "ignore_eos",
)


class InferenceResponses:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving, self.store = serving, store

    async def create(self, body: ResponseRequest, raw: Request) -> JSONResponse | StreamingResponse:
        tenant = acting_principal(raw).tenant
        history: list[ChatMessage] = []
        if body.previous_response_id is not None:
            history = (
                await self.store.load(tenant, body.previous_response_id, "previous_response_id")
            ).messages
        inputs = [*history, *input_messages(body.input, history)]
        tools = chat_tools(body.tools)
        chat = self._chat_request(body, inputs, tools.tools)
        try:
            answer = await self.serving.chat(chat, raw)
        except TandemError as exc:
            raise rename_error(exc, tools.positions) from None
        assembly = ResponseAssembly(ResponseObject.started(body))
        if isinstance(answer, StreamingResponse):
            frames = self._stream(answer.body_iterator, assembly, tenant, inputs if body.store else None)
            return StreamingResponse(frames, media_type="text/event-stream", headers=dict(_SSE_HEADERS))
        completion = json.loads(bytes(answer.body))
        choice = completion["choices"][0]
        message = choice["message"]
        assembly.text(message.get("content") or "")
        for k, call in enumerate(message.get("tool_calls") or []):
            assembly.call(k, call["id"], call["function"]["name"], call["function"]["arguments"])
        assembly.finish(choice.get("finish_reason"), completion.get("usage"))
        if body.store:
            await self.store.save(tenant, assembly.response, inputs)
        return JSONResponse(assembly.response.model_dump(mode="json"))

    @staticmethod
    def _chat_request(
        body: ResponseRequest, inputs: list[ChatMessage], tools: list[dict[str, Any]]
    ) -> ChatCompletionRequest:
        system: list[ChatMessage] = (
            [{"role": "system", "content": body.instructions}] if body.instructions else []
        )
        messages = system + inputs
        if not messages:
            raise InvalidRequest("input must not be empty", param="input")
        extra = {k: v for k, v in (body.model_extra or {}).items() if k in _PASSED_ON}
        fields: dict[str, Any] = {
            "model": body.model,
            "messages": messages,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_tokens": body.max_output_tokens,
            "tools": tools or None,
            "tool_choice": chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": chat_response_format(body.text),
            "user": body.user,
            "stream": body.stream,
            **extra,
        }
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        return chat_request(ChatCompletionRequest, fields)

    async def _stream(
        self,
        chunks: AsyncIterable[Any],
        assembly: ResponseAssembly,
        tenant: str,
        inputs: list[ChatMessage] | None,
    ) -> AsyncIterator[str]:
        """The chat stream's chunks as the response's events; stored at the end when asked."""
        for frame in assembly.start():
            yield frame
        finish: str | None = None
        usage: dict[str, Any] | None = None
        failed = False
        buffer = ""
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]  # an async generator
            async for piece in chunks:
                buffer += piece if isinstance(piece, str) else bytes(piece).decode()
                while "\n\n" in buffer:
                    event, buffer = buffer.split("\n\n", 1)
                    data = event.removeprefix("data: ")
                    if data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = chunk["error"]
                        for frame in assembly.fail(str(error.get("message")), "server_error"):
                            yield frame
                        failed = True
                        break
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        for frame in assembly.text(delta.get("content") or ""):
                            yield frame
                        for call in delta.get("tool_calls") or []:
                            function = call.get("function") or {}
                            for frame in assembly.call(
                                call.get("index", 0),
                                call.get("id"),
                                function.get("name"),
                                function.get("arguments"),
                            ):
                                yield frame
                        finish = choice.get("finish_reason") or finish
                if failed:
                    break
        if failed:
            return
        frames = assembly.finish(finish, usage)
        if inputs is not None:
            # before the last event: a client that saw it may retrieve or continue from it at once
            await self.store.save(tenant, assembly.response, inputs)
        for frame in frames:
            yield frame


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
