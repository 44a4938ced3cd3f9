"""The agent service's core: pipelines, agents, tools and memory, and one chat turn as an event stream.

Every interface (websocket, SSE, JSON, the OpenAI facade) runs a turn through
``AgentRuntime.turn`` and only changes how the events are written out, so they
all behave the same. Events (contracts.md): ``conversation``, ``token``,
``citation``, ``step``, ``error``, ``done``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.agent.agents.runner import AgentRunner, AgentSpec, check_tools
from services.agent.clients import InferenceClient, RetrievalClient
from services.agent.config import AgentSettings
from services.agent.memory import ConversationStore, MemoryLimits
from services.agent.pipelines.definition import Pipeline, load_pipelines
from services.agent.pipelines.state import Event, RunContext, RunState
from services.agent.tokens import load_counter
from services.agent.tools.base import Tool, ToolContext
from services.agent.tools.registry import default_tools
from services.common.auth import Principal
from services.common.config import CommonSettings
from services.common.errors import InvalidRequest, NotFound, PayloadTooLarge, ServiceUnavailable

log = logging.getLogger("tandem.agent")
# Events that mean the answer has started (or ended): interfaces can commit to a streamed response then.
FIRST_OUTPUT = frozenset({"token", "citation", "step", "done", "error"})


@dataclass
class Turn:
    """One user message to a pipeline or an agent."""

    target: str
    message: str
    collection: str | None = None
    conversation_id: str | None = None
    history: list[dict[str, str]] | None = None  # given by the caller (OpenAI facade) instead of memory
    remember: bool = True
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class TurnResult:
    conversation_id: str | None = None
    answer: str = ""
    citations: list[dict[str, Any]] = field(default_factory=list)
    invalid_citations: list[int] = field(default_factory=list)
    results: list[dict[str, Any]] | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    finish_reason: str = "stop"
    error: dict[str, Any] | None = None


class AgentRuntime:
    def __init__(self, common: CommonSettings, settings: AgentSettings, memory: ConversationStore) -> None:
        self.common = common
        self.settings = settings
        self.memory = memory
        self.pipelines: dict[str, Pipeline] = load_pipelines(settings.pipelines_dir or None)
        self.tools, self.tool_errors = default_tools(settings)
        self.agents: dict[str, AgentSpec] = {
            "tools-agent": AgentSpec(
                name="tools-agent",
                description="A ReAct agent with document search, a calculator"
                + (", HTTP GET" if "http_get" in self.tools else "")
                + " and any installed tools.",
                tools=list(self.tools),
                mode=settings.tool_calling,
            ),
        }
        self._model: str | None = settings.model or None
        self._model_lock = asyncio.Lock()

    @classmethod
    def create(cls, common: CommonSettings, settings: AgentSettings, redis: Any) -> AgentRuntime:
        limits = MemoryLimits(
            ttl_s=settings.memory_ttl_s,
            max_messages=settings.memory_max_messages,
            max_conversations=settings.memory_max_conversations,
            max_chars=max(settings.max_message_chars, 32_000),
        )
        return cls(common, settings, ConversationStore(redis, limits))

    # -- clients carry the caller's own key ---------------------------------------------------

    def retrieval(self, api_key: str) -> RetrievalClient:
        return RetrievalClient(self.common.url_of("retrieval"), api_key, self.settings.upstream_timeout_s)

    def inference(self, api_key: str) -> InferenceClient:
        return InferenceClient(self.common.url_of("inference"), api_key, self.settings.upstream_timeout_s)

    async def model(self, inference: InferenceClient) -> str:
        if self._model:
            return self._model
        async with self._model_lock:
            if not self._model:
                models = await inference.models()
                if not models:
                    raise ServiceUnavailable("the inference service lists no model")
                self._model = str(models[0]["id"])
        return self._model

    def catalog(self) -> list[dict[str, str]]:
        out = [
            {"id": p.name, "kind": f"pipeline:{p.spec.kind}", "description": p.spec.description}
            for p in self.pipelines.values()
        ]
        out += [{"id": a.name, "kind": "agent", "description": a.description} for a in self.agents.values()]
        return out

    # -- one turn ---------------------------------------------------------------------------

    def validate(self, turn: Turn) -> None:
        if turn.target not in self.pipelines and turn.target not in self.agents:
            known = ", ".join([*self.pipelines, *self.agents])
            raise NotFound(f"unknown pipeline or agent {turn.target!r} (known: {known})", param="pipeline")
        if not turn.message.strip():
            raise InvalidRequest("the message is empty", param="message")
        if len(turn.message) > self.settings.max_message_chars:
            raise PayloadTooLarge(
                f"the message has {len(turn.message)} characters; the limit is {self.settings.max_message_chars}",
                param="message",
            )
        pipeline = self.pipelines.get(turn.target)
        needs_collection = pipeline is not None and any(
            n.type == "retriever" for n in pipeline.spec.components.values()
        )
        if needs_collection and not turn.collection:
            raise InvalidRequest(f"pipeline {turn.target!r} needs a 'collection'", param="collection")

    async def turn(
        self, principal: Principal, api_key: str, turn: Turn, result: TurnResult
    ) -> AsyncIterator[Event]:
        """Streams the events of one turn; fills ``result``. Raises TandemError for bad input
        found before the first answer event (so HTTP interfaces can still answer 4xx)."""
        self.validate(turn)
        tenant, user = principal.tenant, principal.key_id
        history = list(turn.history or [])
        created = False
        partial: list[str] = []
        if turn.remember:
            if turn.conversation_id:
                history = await self.memory.history(tenant, user, turn.conversation_id)
                result.conversation_id = turn.conversation_id
            else:
                result.conversation_id = await self.memory.create(
                    tenant,
                    user,
                    title=turn.message[:80],
                    pipeline=turn.target,
                    collection=turn.collection or "",
                )
                created = True
            yield {"type": "conversation", "conversation_id": result.conversation_id}
        try:
            if turn.target in self.pipelines:
                events = self._run_pipeline(api_key, turn, history, result)
            else:
                events = self._run_agent(api_key, turn, history, result)
            async for event in events:
                if event["type"] == "token":
                    partial.append(event["text"])
                elif event["type"] == "step":
                    result.steps.append(event)
                elif event["type"] == "error":
                    result.error = event
                yield event
        except asyncio.CancelledError:
            # Stopped by the user or a disconnect: keep what was said so far.
            if turn.remember and result.conversation_id:
                said = {"role": "assistant", "content": "".join(partial), "stopped": True}
                await self.memory.append(
                    tenant, user, result.conversation_id, [{"role": "user", "content": turn.message}, said]
                )
            raise
        except BaseException:
            if created and result.conversation_id:
                await self.memory.delete(tenant, user, result.conversation_id)
                result.conversation_id = None
            raise
        if turn.remember and result.conversation_id:
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": result.answer,
                "citations": result.citations,
            }
            if result.steps:
                assistant["steps"] = result.steps
            await self.memory.append(
                tenant, user, result.conversation_id, [{"role": "user", "content": turn.message}, assistant]
            )
        done: Event = {
            "type": "done",
            "conversation_id": result.conversation_id,
            "citations": result.citations,
            "finish_reason": result.finish_reason,
        }
        if result.usage:
            done["usage"] = result.usage
        if result.results is not None:
            done["results"] = result.results
        if result.invalid_citations:
            done["invalid_citations"] = result.invalid_citations
        yield done

    async def _run_pipeline(
        self, api_key: str, turn: Turn, history: list[dict[str, str]], result: TurnResult
    ) -> AsyncIterator[Event]:
        pipeline = self.pipelines[turn.target]
        inference = self.inference(api_key)
        uses_model = any(n.type == "generator" for n in pipeline.spec.components.values())
        ctx = RunContext(
            settings=self.settings,
            retrieval=self.retrieval(api_key),
            inference=inference,
            counter=load_counter(self.settings.tokenizer),
            model=await self.model(inference) if uses_model else "",
        )
        state = RunState(
            question=turn.message, collection=turn.collection, history=history, options=turn.options
        )
        async for event in pipeline.run(state, ctx):
            yield event
        result.answer = state.answer
        result.citations = [c.to_dict() for c in state.citations]
        result.invalid_citations = state.invalid_citations
        result.results = state.results
        result.usage = state.usage
        result.finish_reason = state.finish_reason

    async def _run_agent(
        self, api_key: str, turn: Turn, history: list[dict[str, str]], result: TurnResult
    ) -> AsyncIterator[Event]:
        spec = self.agents[turn.target]
        inference = self.inference(api_key)
        tools: dict[str, Tool] = check_tools(spec, self.tools)
        runner = AgentRunner(
            inference=inference,
            model=await self.model(inference),
            tools=tools,
            tool_ctx=ToolContext(retrieval=self.retrieval(api_key), collection=turn.collection),
            max_steps=self.settings.agent_max_steps,
            time_budget_s=self.settings.agent_time_budget_s,
            tool_timeout_s=self.settings.tool_timeout_s,
            max_tokens=self.settings.max_answer_tokens,
        )
        async for event in runner.run(turn.message, history, mode=spec.mode):
            yield event
        result.answer = runner.result.answer
        result.finish_reason = runner.result.finish_reason


async def peek(events: AsyncIterator[Event]) -> tuple[list[Event], AsyncIterator[Event]]:
    """Pulls events until the answer starts, so errors found before then still raise (→ HTTP 4xx);
    returns the buffered events and the rest of the stream."""
    buffered: list[Event] = []
    async for event in events:
        buffered.append(event)
        if event["type"] in FIRST_OUTPUT:
            break
    return buffered, events


async def collect(events: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in events]
