"""OpenAI's Responses API on the agent service: ``model`` names a pipeline or agent, as on the chat
facade (services/agent/openai_chat.py), which answers it: the request is read into a facade chat
request (services/common/responses_input.py), and its answer or chunks become the ``response``
object or its typed events (services/common/responses_stream.py).

Extra fields as on the facade: ``collection``, ``conversation_id``, ``llm``. The turn's citations
are the ``file_citation`` annotations of the answer's text (``file_id`` the document id,
``filename`` its title, ``index`` where its marker ``[n]`` is, else the end of the text).
Tools of type ``mcp`` name registered MCP servers (``server_label``) whose tools join an agent's
run; each call the agent made to one is an ``mcp_call`` output item. ``instructions`` are not
sent: the pipeline or agent writes its own (the facade leaves system messages out too).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from services.agent.events import ErrorEvent
from services.agent.openai_chat import OpenAIChat
from services.agent.protocol import (
    AnswerCitation,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    StreamError,
)
from services.agent.runtime import AgentRuntime
from services.common.auth import Principal
from services.common.bounds import NAME_CHARS
from services.common.chat_messages import ChatMessage
from services.common.errors import InvalidRequest, TandemError
from services.common.jsonsafe import JsonObject
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
from services.common.responses_wire import FileCitation, McpCallItem, ResponseObject, ResponseRequest, new_id

_COLLECTION = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class AgentResponseRequest(ResponseRequest):
    collection: str | None = Field(
        None, max_length=64, pattern=_COLLECTION, description="The collection a pipeline reads."
    )
    conversation_id: str | None = Field(None, max_length=NAME_CHARS)
    llm: str | None = Field(None, min_length=1, max_length=256, description="The model that generates.")


def file_citations(text: str, citations: list[AnswerCitation]) -> list[FileCitation]:
    """The turn's citations as ``file_citation`` annotations of ``text``."""
    out = []
    for c in citations:
        marker = re.search(rf"\[\s*(?:\d+\s*[,;]\s*)*{c.index}\s*(?:[,;]\s*\d+\s*)*\]", text)
        out.append(
            FileCitation(
                file_id=c.document_id,
                filename=c.title or c.document_id,
                index=marker.start() if marker else len(text),
            )
        )
    return out


def _mcp_servers(others: list[tuple[int, JsonObject]]) -> list[str]:
    servers = []
    for i, tool in others:
        label = tool.get("server_label")
        if not isinstance(label, str) or not label:
            raise InvalidRequest(
                f"tools[{i}].server_label must name a registered MCP server", param=f"tools[{i}].server_label"
            )
        servers.append(label)
    if servers and "mcp_servers" not in ChatCompletionRequest.model_fields:
        i = others[0][0]
        raise InvalidRequest(
            f"tools[{i}]: the mcp tool type needs a registered MCP server, and this service has none",
            param=f"tools[{i}].type",
        )
    return servers


def mcp_calls(steps: list[dict[str, Any]], servers: list[str]) -> list[McpCallItem]:
    """The agent's calls to the servers' tools (named ``<server>__<tool>``) with their results."""
    items: list[McpCallItem] = []
    pending: McpCallItem | None = None
    for step in steps:
        kind, tool = step.get("kind"), str(step.get("tool") or "")
        server = next((s for s in servers if tool.startswith(f"{s}__")), None)
        if kind == "tool_call":
            pending = None
            if server is not None:
                argument = step.get("input")
                pending = McpCallItem(
                    id=new_id("mcp"),
                    server_label=server,
                    name=tool[len(server) + 2 :],
                    arguments=argument if isinstance(argument, str) else json.dumps(argument),
                )
                items.append(pending)
        elif kind == "observation" and pending is not None:
            if step.get("ok", True):
                pending.output = str(step.get("text", ""))
            else:
                pending.error = str(step.get("text", ""))
            pending = None
    return items


class AgentResponses:
    """One ``POST /v1/responses``: bad input raises (its 4xx) in ``start``, before any answer."""

    def __init__(
        self,
        runtime: AgentRuntime,
        principal: Principal,
        key: str,
        store: ResponseStore,
        body: AgentResponseRequest,
    ) -> None:
        self.runtime, self.principal, self.key, self.store, self.body = runtime, principal, key, store, body
        self.inputs: list[ChatMessage] = []
        self.servers: list[str] = []
        self.assembly = ResponseAssembly(ResponseObject.started(body))
        self._positions: list[int] = []
        self._mcp_param = "tools"

    async def start(self) -> OpenAIChat:
        body = self.body
        if body.previous_response_id is not None:
            stored = await self.store.load(
                self.principal.tenant, body.previous_response_id, "previous_response_id", self.principal
            )
            self.inputs = list(stored.messages)
        self.inputs += input_messages(body.input, self.inputs)
        tools = chat_tools(body.tools, also=("mcp",))
        self.servers = _mcp_servers(tools.others)
        fields: dict[str, Any] = {
            "model": body.model,
            "messages": self.inputs,
            "collection": body.collection,
            "conversation_id": body.conversation_id,
            "llm": body.llm,
            "stream": body.stream,
            "user": body.user,
            "tools": tools.tools or None,
            "tool_choice": chat_tool_choice(body.tool_choice),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": chat_response_format(body.text),
            "max_tokens": body.max_output_tokens,
        }
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        if self.servers:
            fields["mcp_servers"] = self.servers
        self._positions = tools.positions
        self._mcp_param = f"tools[{tools.others[0][0]}].server_label" if tools.others else "tools"
        try:
            return OpenAIChat(
                self.runtime, self.principal, self.key, chat_request(ChatCompletionRequest, fields)
            )
        except TandemError as exc:
            raise self.renamed(exc) from None

    def renamed(self, exc: TandemError) -> TandemError:
        """A 4xx of the chat path, naming the Responses field it came from."""
        if exc.param == "mcp_servers":
            exc.message, exc.param = exc.message.replace("mcp_servers", self._mcp_param), self._mcp_param
            exc.args = (exc.message,)
        return rename_error(exc, self._positions)

    async def _save(self) -> None:
        if self.body.store:
            # the asker's, as a conversation is: it may quote collections only they may read
            await self.store.save(
                self.principal.tenant, self.assembly.response, self.inputs, self.principal.owner
            )

    def _ids(self, message_id: str | None, conversation_id: str | None) -> None:
        extra = self.assembly.response.__pydantic_extra__
        if extra is not None:
            extra.update(message_id=message_id or None, conversation_id=conversation_id)

    async def answer(self, chat: OpenAIChat) -> ResponseObject | ErrorEvent:
        try:
            answer = await chat.answer()
        except TandemError as exc:
            raise self.renamed(exc) from None
        if isinstance(answer, ErrorEvent):
            return answer
        assert isinstance(answer, ChatCompletion)
        choice, assembly = answer.choices[0], self.assembly
        for item in mcp_calls(chat.result.steps, self.servers):
            assembly.mcp_call(item)
        text = choice.message.content or ""
        assembly.text(text)
        for k, call in enumerate(choice.message.tool_calls or []):
            assembly.call(k, call.id, call.function.name, call.function.arguments)
        self._ids(answer.message_id, answer.conversation_id)
        usage = answer.usage.model_dump()
        assembly.finish(choice.finish_reason, usage, file_citations(text, answer.citations))
        await self._save()
        return assembly.response

    async def stream(self, chat: OpenAIChat) -> AsyncIterator[str]:
        """Runs the turn up to its first output (errors before it raise), then the events."""
        try:
            chunks = await chat.stream()
        except TandemError as exc:
            raise self.renamed(exc) from None
        return self._events(chunks, chat)

    async def _events(
        self, chunks: AsyncIterator[ChatCompletionChunk | StreamError], chat: OpenAIChat
    ) -> AsyncIterator[str]:
        assembly = self.assembly
        for frame in assembly.start():
            yield frame
        text, finish, usage, citations = "", None, None, []
        sent = 0  # MCP calls sent so far (each as soon as its result is in)
        async for chunk in chunks:
            if isinstance(chunk, StreamError):
                for frame in assembly.fail(chunk.error.message, "server_error"):
                    yield frame
                return
            calls = mcp_calls(chat.result.steps, self.servers)
            for item in calls[sent:]:
                if item.output is None and item.error is None:
                    break
                sent += 1
                for frame in assembly.mcp_call(item):
                    yield frame
            if chunk.citations is not None:
                citations = chunk.citations
                self._ids(chunk.message_id, chunk.conversation_id)
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    text += delta.content
                    for frame in assembly.text(delta.content):
                        yield frame
                for call in delta.tool_calls or []:
                    function = call.function
                    name, arguments = (function.name, function.arguments) if function else (None, None)
                    for frame in assembly.call(call.index, call.id, name, arguments):
                        yield frame
                finish = choice.finish_reason or finish
        frames = assembly.close_text(finish, file_citations(text, citations))
        for item in mcp_calls(chat.result.steps, self.servers)[sent:]:
            frames += assembly.mcp_call(item)
        frames += assembly.finish(finish, usage)
        await self._save()  # before the last event: a client that saw it may continue from it at once
        for frame in frames:
            yield frame
