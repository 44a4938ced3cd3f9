"""The agent service's core: pipelines, agents, tools and memory, and one chat turn as an event stream.

Every interface (websocket, SSE, JSON, the OpenAI facade) runs a turn through
``AgentRuntime.turn`` and only changes how the events are written out, so they
all behave the same. Events (contracts.md): ``conversation``, ``token``,
``citation``, ``reset``, ``step``, ``error``, ``done``, typed in services/agent/events.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.agent.agents.runner import AgentRunner, AgentSpec, check_tools
from services.agent.approvals import Approval, ApprovalStore, PerformedCall
from services.agent.chunks import Chunk
from services.agent.citations import CitationTracker
from services.agent.clients import InferenceClient
from services.agent.config import AgentSettings
from services.agent.events import (
    ApprovalRequiredEvent,
    ConversationEvent,
    DoneEvent,
    ErrorEvent,
    FinalStep,
    ObservationStep,
    ResetEvent,
    ThoughtStep,
    TokenEvent,
    ToolCallStep,
    ToolsStep,
)
from services.agent.feedback import FeedbackWriter
from services.agent.mcp_servers import McpServerStore, load_cipher
from services.agent.memory import ConversationStore, MemoryLimits
from services.agent.model_access import CallerModels
from services.agent.model_choice import PromotionStore
from services.agent.pipeline_answers import PipelineAnswers
from services.agent.pipelines.components import CiteNode, Component, GenerateNode
from services.agent.pipelines.definition import Pipeline, load_pipelines
from services.agent.pipelines.state import AnswerForm, AnswerKind, Event, RunState, TurnOptions
from services.agent.promotions import PromotionGate
from services.agent.prompting import PromptPlan
from services.agent.protocol import Message, PipelineRunRequest, ReaderChoice, TurnRecord, wire_messages
from services.agent.quality import QualityMetrics, answer_quality
from services.agent.tools.base import Tool, ToolContext, call_fingerprint
from services.agent.tools.registry import default_tools
from services.agent.turns import SqliteTurnStore, TurnStore, new_message_id, owner_scope
from services.agent.upstreams import ServedModels, Upstreams
from services.common.auth import Principal
from services.common.config import CommonSettings
from services.common.errors import InvalidRequest, NotFound, PayloadTooLarge, TandemError
from services.common.model_restrictions import ModelRestrictions
from services.common.openai_wire import ToolCall

log = logging.getLogger("tandem.agent")
# Events that mean the answer has started (or ended): interfaces can commit to a streamed response then.
FIRST_OUTPUT = frozenset({"token", "tool_call_delta", "citation", "step", "done", "error"})


@dataclass
class Turn:
    """One user message to a pipeline or an agent."""

    target: str
    message: str
    collection: str | None = None
    conversation_id: str | None = None
    history: list[Message] | None = None  # given by the caller (OpenAI facade) instead of memory
    remember: bool = True
    options: TurnOptions = field(default_factory=TurnOptions)
    llm: str | None = None  # the model that generates; None: the conversation's, else the default
    form: AnswerForm | None = None  # the caller's tools / response_format (OpenAI facade)
    mcp_servers: list[str] = field(default_factory=list)  # the caller's registered MCP servers (agents)
    # Asked again after a decision on a held tool call: the user's message is already in the
    # conversation, and ``history`` is what the first run saw. The calls decided so far:
    resumed: bool = False
    approved: frozenset[str] = frozenset()
    denied: frozenset[str] = frozenset()
    performed: dict[str, tuple[str, bool]] = field(default_factory=dict)

    @classmethod
    def of_run(cls, target: str, body: PipelineRunRequest) -> Turn:
        """The turn a run request asks for (REST `POST /v1/pipelines/{name}/run` and MCP tools)."""
        return cls(
            target=target,
            message=body.question(),
            collection=body.collection,
            conversation_id=body.conversation_id,
            history=[Message(role=m.role, content=m.text()) for m in body.history or []],
            remember=body.remember or body.conversation_id is not None,
            options={"top_k": body.top_k} if body.top_k else {},
            llm=body.llm,
            mcp_servers=list(body.mcp_servers or []),
        )


@dataclass
class TurnResult:
    conversation_id: str | None = None
    message_id: str = ""
    model: str = ""  # the model that generated (empty when none was called)
    draft_of: str | None = None
    answer: str = ""
    citations: list[dict[str, Any]] = field(default_factory=list)
    invalid_citations: list[int] = field(default_factory=list)
    results: list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # the model's calls (the caller's tools)
    steps: list[dict[str, Any]] = field(default_factory=list)  # the agent's step events, as sent
    usage: dict[str, int] = field(default_factory=dict)
    finish_reason: str = "stop"
    error: ErrorEvent | None = None
    # The groundedness guard's outcome (pipelines with a groundedness_guard only).
    answer_kind: AnswerKind = "generated"
    unsupported: list[dict[str, Any]] = field(default_factory=list)
    grounding: str | None = None
    # Where the turn record is read from: the pipeline's state or the agent's run.
    state: RunState | None = None
    agent_run: Any = None

    def take_answer(self, state: RunState) -> None:
        """What a pipeline run (or a regenerated draft) answered."""
        self.answer = state.answer
        self.citations = [c.to_dict() for c in state.citations]
        self.invalid_citations = state.invalid_citations
        self.usage = state.usage
        self.finish_reason = state.finish_reason
        self.tool_calls = state.tool_calls

    def pipeline_answer(self, pipeline: str, query: str, error: ErrorEvent | None) -> dict[str, Any]:
        """The JSON answer of POST /v1/pipelines/{name}/run: results (search) or the answer (chat)."""
        out: dict[str, Any] = {"pipeline": pipeline, "query": query, "message_id": self.message_id}
        if self.model:
            out["model"] = self.model
        if self.conversation_id:
            out["conversation_id"] = self.conversation_id
        if self.results is not None:
            out["results"] = self.results
        else:
            out.update(
                answer=self.answer,
                citations=self.citations,
                invalid_citations=self.invalid_citations,
                usage=self.usage,
                finish_reason=self.finish_reason,
            )
            if self.state is not None and not self.state.structured:
                out["answer_kind"] = self.answer_kind
            if self.grounding is not None:
                out.update(kind=self.answer_kind, grounding=self.grounding, unsupported=self.unsupported)
        if self.steps:
            out["steps"] = self.steps
        if error is not None:
            out["error"] = {"message": error.message, "code": error.code}
        return out

    def turn_done(self) -> DoneEvent:
        """The ``done`` event of a turn: with a search's results, a chat pipeline's answer kind and
        the groundedness guard's verdict where they apply."""
        done = self.done_event(model=self.model or None)
        if self.results is not None:
            done.results = self.results
        if self.state is not None and self.results is None and not self.state.structured:
            done.answer_kind = self.answer_kind  # a chat pipeline's text answer
        if self.grounding is not None:
            done.kind = self.answer_kind
            done.grounding = self.grounding
            done.unsupported = self.unsupported
        return done

    def done_event(self, **fields: Any) -> DoneEvent:
        """The turn's ``done``; ``usage`` and ``invalid_citations`` only when there are any."""
        done = DoneEvent(
            conversation_id=self.conversation_id,
            message_id=self.message_id,
            **fields,
            citations=self.citations,
            finish_reason=self.finish_reason,
        )
        if self.usage:
            done.usage = self.usage
        if self.invalid_citations:
            done.invalid_citations = self.invalid_citations
        return done


@dataclass
class _Run:
    """One turn's run of a pipeline or an agent: its model client, the caller's key, the model."""

    inference: InferenceClient
    api_key: str
    turn: Turn
    llm: str | None
    history: list[Message]
    result: TurnResult
    mcp_tools: dict[str, Tool] = field(default_factory=dict)  # the run's MCP servers' tools
    reader: ReaderChoice | None = None  # the tenant's promoted reader (pipelines)


class AgentRuntime:
    """What a turn needs, built once per process; the components below it (the pipelines, the
    agents, the promotion gate, evaluation runs) receive the parts they use, never the runtime."""

    def __init__(
        self,
        common: CommonSettings,
        settings: AgentSettings,
        memory: ConversationStore,
        turns: TurnStore,
        mcp: McpServerStore | None = None,
    ) -> None:
        self.common = common
        self.mcp = mcp or McpServerStore(memory.r, load_cipher(settings, common.home_dir), settings)
        self.settings = settings
        self.memory = memory
        self.turns = turns
        self.upstreams = Upstreams(common, settings.upstream_timeout_s)
        self.models = ServedModels(settings.model)
        self.quality = QualityMetrics()  # on the app's /metrics (app.py registers it)
        self.feedback = FeedbackWriter(turns, self.quality, settings)
        self.promotions = PromotionStore(turns, ModelRestrictions(memory.r))
        self.approvals = ApprovalStore(memory.r, settings.approval_ttl_s)
        self.pipelines: dict[str, Pipeline] = load_pipelines(settings.pipelines_dir or None)
        self.answers = PipelineAnswers(settings, self.pipelines, self.upstreams, self.models)
        self.gate = PromotionGate(
            self.promotions,
            turns,
            self.answers,
            self.upstreams,
            memory.r,
            common.service_api_key,
            settings,
        )
        self.tools, self.tool_errors = default_tools(settings)
        self.agents: dict[str, AgentSpec] = {
            "tools-agent": AgentSpec(
                name="tools-agent",
                description="An agent (OpenAI tool calls, or ReAct) with document search, a calculator"
                + (", HTTP GET" if "http_get" in self.tools else "")
                + " and any installed tools.",
                tools=list(self.tools),
                mode=settings.tool_calling,
                side_effects=settings.tool_side_effects,
            ),
        }

    @classmethod
    def create(cls, common: CommonSettings, settings: AgentSettings, redis: Any) -> AgentRuntime:
        limits = MemoryLimits(
            ttl_s=settings.memory_ttl_s,
            max_messages=settings.memory_max_messages,
            max_conversations=settings.memory_max_conversations,
            max_chars=max(settings.max_message_chars, 32_000),
        )
        turns = SqliteTurnStore(common.home_dir / "agent" / "turns.sqlite3")
        mcp = McpServerStore(redis, load_cipher(settings, common.home_dir), settings)
        return cls(common, settings, ConversationStore(redis, limits), turns, mcp)

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
        tool_turns = any(m.role == "tool" or m.tool_calls for m in turn.history or [])
        if turn.form is not None or tool_turns:
            self._check_form(turn, turn.form or AnswerForm(), pipeline, tool_turns)
        if turn.mcp_servers and pipeline is not None:
            raise InvalidRequest(
                f"mcp_servers: pipeline {turn.target!r} calls no tools; MCP servers join an agent's run "
                f"(e.g. {next(iter(self.agents))!r})",
                param="mcp_servers",
            )

    def _check_form(self, turn: Turn, form: AnswerForm, pipeline: Pipeline | None, tool_turns: bool) -> None:
        """Tools and response_format reach a pipeline's generator; an agent runs its own tools and
        writes its own answer, and a search pipeline writes none: both refuse them (a 400 naming the
        field), rather than answer in a form the caller did not ask for."""
        given = [name for name in ("tools", "tool_choice") if form.body().get(name)]
        if form.response_format and form.response_format.get("type") != "text":
            given.append("response_format")
        if form.tail or tool_turns:
            given.append("messages")
        if not given:
            return
        if pipeline is None:
            what = "tool results in messages" if given[0] == "messages" else given[0]
            raise InvalidRequest(
                f"{what} are not supported by agent {turn.target!r}, which runs its own tools; "
                "use a pipeline (e.g. chat-documents)",
                param=given[0],
            )
        if not any(n.type == "generator" for n in pipeline.spec.components.values()):
            raise InvalidRequest(
                f"pipeline {turn.target!r} searches and generates nothing: {given[0]} needs a chat "
                "pipeline (e.g. chat-documents)",
                param=given[0],
            )
        if turn.remember and turn.conversation_id and (form.tools or form.tail or tool_turns):
            raise InvalidRequest(
                "a conversation remembers text turns only: with tools, send the history (tool calls "
                "and results included) in messages instead of a conversation_id",
                param="conversation_id",
            )

    def caller_models(self, principal: Principal) -> CallerModels:
        """What of the tenant's fine-tunes from feedback ``principal`` may be served
        (services/agent/model_access.py)."""
        return CallerModels(self.promotions.restrictions, principal)

    async def _answerers(
        self,
        principal: Principal,
        api_key: str,
        turn: Turn,
        remembered: str | None,
        inference: InferenceClient,
        message_id: str,
    ) -> tuple[str | None, ReaderChoice | None]:
        """The model and the reader a turn answers with: the model the turn names (checked), else
        the conversation's, else for a pipeline the tenant's promoted one (or its canary, for a
        share of turns); for a pipeline, the tenant's promoted reader (None: the agent's setting).
        A fine-tune the caller may not be served is a 403 where named, passed over where not."""
        if turn.llm:
            await self.models.check(inference, turn.llm)
        llm = turn.llm or remembered
        models = self.caller_models(principal)
        if llm:
            await models.check_named(llm)
        if turn.target not in self.pipelines:
            return llm, None
        choice = await self.promotions.choice(principal.tenant)
        return llm or await models.default(choice, message_id), await models.reader(choice)

    async def turn(
        self, principal: Principal, api_key: str, turn: Turn, result: TurnResult
    ) -> AsyncIterator[Event]:
        """Streams the events of one turn; fills ``result``. Raises TandemError for bad input
        found before the first answer event (so HTTP interfaces can still answer 4xx)."""
        run, meta = await self._prepare(principal, api_key, turn, result)
        created = False
        if turn.remember:
            created = await self._open_conversation(principal, run, meta)
            yield ConversationEvent(conversation_id=result.conversation_id)
        partial: list[str] = []  # the answer streamed so far, kept if the turn is stopped
        try:
            async for event in self._stream(principal, run, partial):
                yield event
        except asyncio.CancelledError:
            # Stopped by the user or a disconnect: keep what was said so far (and its record).
            await self._keep_stopped(principal, turn, result, "".join(partial))
            raise
        except BaseException:
            if created and result.conversation_id:
                await self.memory.delete(principal.tenant, principal.key_id, result.conversation_id)
                result.conversation_id = None
            raise
        await self._keep_answer(principal, turn, result)
        yield result.turn_done()

    async def _prepare(
        self, principal: Principal, api_key: str, turn: Turn, result: TurnResult
    ) -> tuple[_Run, dict[str, str]]:
        """The run of a valid turn (its model, reader and MCP tools) and its conversation's
        metadata: every check that can refuse the turn happens here, before any event."""
        self.validate(turn)
        inference = self.upstreams.inference(api_key)
        mcp_tools: dict[str, Tool] = {}
        if turn.target in self.agents:
            # before any event: an unknown server name is still a 404
            spec = self.agents[turn.target]
            mcp_tools = await self.mcp.agent_tools(
                principal.tenant, spec.name, turn.mcp_servers, spec.mcp_servers
            )
        meta: dict[str, str] = {}
        if turn.remember and turn.conversation_id:
            meta = await self.memory.meta(principal.tenant, principal.key_id, turn.conversation_id)
        result.message_id = new_message_id()
        llm, reader = await self._answerers(
            principal, api_key, turn, meta.get("llm") or None, inference, result.message_id
        )
        history = list(turn.history or [])
        return _Run(inference, api_key, turn, llm, history, result, mcp_tools, reader), meta

    async def _open_conversation(self, principal: Principal, run: _Run, meta: dict[str, str]) -> bool:
        """The remembered turn's conversation (its history read into ``run``), or a new one
        (True), with the user's message appended."""
        tenant, user, turn, result = principal.tenant, principal.key_id, run.turn, run.result
        created = False
        if turn.conversation_id:
            if not turn.resumed:
                run.history = await self.memory.history(tenant, user, turn.conversation_id)
            result.conversation_id = turn.conversation_id
            if turn.llm and turn.llm != meta.get("llm"):
                await self.memory.set_llm(tenant, user, turn.conversation_id, turn.llm)
        else:
            result.conversation_id = await self.memory.create(
                tenant,
                user,
                title=turn.message[:80],
                pipeline=turn.target,
                collection=turn.collection or "",
                llm=turn.llm or "",
            )
            created = True
        # The user's message is kept before any work: a turn cut short by a crash of this
        # process still leaves what the user asked in the conversation.
        if not turn.resumed:
            await self.memory.append(
                tenant, user, result.conversation_id, [{"role": "user", "content": turn.message}]
            )
        return created

    async def _stream(self, principal: Principal, run: _Run, partial: list[str]) -> AsyncIterator[Event]:
        """The pipeline's or the agent's events, noted in ``run.result`` (steps, error) and
        ``partial`` (the streamed text) as they pass; a tool call held for approval is kept."""
        turn, result = run.turn, run.result
        events = self._run_pipeline(run) if turn.target in self.pipelines else self._run_agent(run)
        async for event in events:
            if isinstance(event, ApprovalRequiredEvent):
                held = await self._hold(principal, turn, run.llm, run.history, result, event)
                event.expires_at = held.expires_at
            if isinstance(event, TokenEvent):
                partial.append(event.text)
            elif isinstance(event, ResetEvent):
                partial.clear()  # the guard replaces what streamed so far
            elif isinstance(
                event,
                ThoughtStep | ToolCallStep | ObservationStep | FinalStep | ToolsStep | ApprovalRequiredEvent,
            ):
                result.steps.append(event.wire())
            elif isinstance(event, ErrorEvent):
                result.error = event
            yield event

    async def _keep_stopped(self, principal: Principal, turn: Turn, result: TurnResult, said: str) -> None:
        """A stopped turn's record and, in its conversation, what it said so far."""
        try:
            await self._save_record(principal, turn, result, said, "stopped")
        except Exception:
            log.exception("could not record the stopped turn %s", result.message_id)
        if turn.remember and result.conversation_id:
            message = {"role": "assistant", "content": said, "stopped": True, "message_id": result.message_id}
            await self.memory.append(principal.tenant, principal.key_id, result.conversation_id, [message])

    async def _keep_answer(self, principal: Principal, turn: Turn, result: TurnResult) -> None:
        """The turn's record and, in its conversation, the answer. Recorded before 'done' goes
        out: a client may rate the answer as soon as it sees it."""
        await self._save_record(principal, turn, result, result.answer, result.finish_reason)
        if turn.remember and result.conversation_id:
            assistant: dict[str, Any] = {
                "role": "assistant",
                "content": result.answer,
                "citations": result.citations,
                "message_id": result.message_id,
            }
            if result.steps:
                assistant["steps"] = result.steps
            await self.memory.append(principal.tenant, principal.key_id, result.conversation_id, [assistant])

    async def _hold(
        self,
        principal: Principal,
        turn: Turn,
        llm: str | None,
        history: list[Message],
        result: TurnResult,
        event: ApprovalRequiredEvent,
    ) -> Approval:
        """Keeps the turn a run stopped in, for ``resume`` to ask again once a person decided."""
        runner: AgentRunner = result.agent_run
        approval = Approval(
            approval_id=event.approval_id,
            owner=principal.owner,
            created_at=0.0,
            expires_at=0.0,
            agent=turn.target,
            message=turn.message,
            collection=turn.collection,
            conversation_id=result.conversation_id,
            remember=turn.remember and result.conversation_id is not None,
            llm=llm,
            mcp_servers=list(turn.mcp_servers),
            history=wire_messages(history),
            tool=event.tool,
            arguments=event.arguments,
            call=call_fingerprint(event.tool, event.arguments),
            approved=sorted(runner.approved),
            denied=sorted(runner.denied),
            performed=[PerformedCall(call=c, text=t, ok=ok) for c, (t, ok) in runner.performed.items()],
        )
        return await self.approvals.hold(principal.tenant, approval)

    async def resume(
        self, principal: Principal, api_key: str, approval_id: str, approve: bool, result: TurnResult
    ) -> AsyncIterator[Event]:
        """Records the decision on a held tool call and asks the turn again with that exact call
        (same tool, same arguments) allowed or refused; a different call still stops the run. The
        approval's errors (404, 409, 410) raise before any event."""
        approval = await self.approvals.decide(principal.tenant, principal.owner, approval_id, approve)
        decided = frozenset({approval.call})
        turn = Turn(
            target=approval.agent,
            message=approval.message,
            collection=approval.collection,
            conversation_id=approval.conversation_id,
            history=approval.messages(),
            remember=approval.remember,
            llm=approval.llm,
            mcp_servers=approval.mcp_servers,
            resumed=True,
            approved=frozenset(approval.approved) | (decided if approve else frozenset()),
            denied=frozenset(approval.denied) | (frozenset() if approve else decided),
            performed={p.call: (p.text, p.ok) for p in approval.performed},
        )
        async for event in self.turn(principal, api_key, turn, result):
            yield event

    async def _save_record(
        self, principal: Principal, turn: Turn, result: TurnResult, answer: str, finish_reason: str
    ) -> None:
        """The turn record: the exact prompt of the (last) model call, the model and what it said."""
        record = TurnRecord(
            message_id=result.message_id,
            conversation_id=result.conversation_id,
            pipeline=turn.target,
            collection=turn.collection,
            model="",
            created_at=time.time(),
            question=turn.message,
            answer=answer,
            completion=answer,
            citations=result.citations,
            finish_reason=finish_reason,
            tool_calls=[c.model_dump() for c in result.tool_calls],
        )
        if result.state is not None:
            state: RunState = result.state
            record.model = state.model
            record.prompt = wire_messages(state.prompt or [])
            record.sampling = state.sampling
            record.chunk_ids = [c.chunk_id for c in state.chunks] if state.prompt is not None else []
            record.sources = [c.to_result() for c in state.chunks] if state.prompt is not None else []
            # What the model wrote, not what the groundedness guard showed instead.
            record.completion = state.completion if state.prompt is not None else answer
            record.answer_kind = state.answer_kind
            if finish_reason == "stopped":
                record.answer = state.answer or answer
                record.completion = state.completion or record.answer
        elif result.agent_run is not None:
            run = result.agent_run.result
            record.kind = "agent"
            record.model = result.agent_run.model
            record.prompt = list(run.prompt)
            record.sampling = run.sampling
            # The raw reply of the last call (e.g. "Thought: ...\nFinal Answer: ..."): what the prompt continues to.
            record.completion = run.completion or answer
        if not record.prompt:
            record.model = ""  # nothing was generated (a search, or "I don't know" without a model call)
        result.model = record.model
        state_ = result.state
        if state_ is not None and result.results is None and not state_.structured:
            # A chat answer: its quality is what the pipeline worked out while answering.
            record.quality = answer_quality(
                groundedness=state_.groundedness,
                citations=record.citations,
                answer_kind=record.answer_kind,
                model=record.model,
            )
        await self.turns.add_turn(principal.tenant, principal.key_id, record)
        if record.quality is not None:
            self.quality.observe_answer(principal.tenant, record.pipeline, record.quality)

    async def regenerate(
        self, principal: Principal, api_key: str, message_id: str, result: TurnResult
    ) -> AsyncIterator[Event]:
        """A new draft of a recorded answer: the exact recorded prompt and model, sampled (not greedy)
        so it can differ. It gets its own record, with ``draft_of`` naming the first answer."""
        original = await self.turns.get_turn(principal.tenant, message_id, owner_scope(principal))
        if original is None:
            raise NotFound(f"no message {message_id!r}", param="message_id")
        if original.kind != "pipeline" or not original.prompt:
            raise InvalidRequest(
                f"message {message_id!r} was not written by a model from a pipeline's prompt "
                "(an agent's answer, a search or an answer without sources): there is nothing to regenerate",
                param="message_id",
            )
        await self.caller_models(principal).check_named(original.model, "message_id")
        chunks = [Chunk.from_result(s) for s in original.sources]
        state = RunState(
            question=original.question,
            collection=original.collection,
            options={"temperature": self.settings.regenerate_temperature},
        )
        state.chunks = chunks
        prompt = [Message.model_validate(m) for m in original.prompt]
        state.plan = PromptPlan(messages=prompt, sources=chunks, prompt_tokens=0, budget=0)
        state.tracker = CitationTracker(chunks)
        ctx = self.answers.fixed_context(api_key, original.model)
        pipeline = self.pipelines.get(original.pipeline)
        nodes: list[Component] = []
        if pipeline is not None:
            nodes = [
                pipeline.nodes[name]
                for name in pipeline.order
                if pipeline.spec.components[name].type in ("generator", "citation_resolver")
            ]
        if not nodes:
            nodes = [GenerateNode(GenerateNode.P.model_validate({})), CiteNode(CiteNode.P.model_validate({}))]
        result.message_id = new_message_id()
        result.draft_of = original.draft_of or original.message_id
        result.conversation_id = original.conversation_id
        for node in nodes:
            async for event in node.run(state, ctx):
                yield event
        result.take_answer(state)
        result.model = original.model
        draft = TurnRecord(
            message_id=result.message_id,
            conversation_id=original.conversation_id,
            pipeline=original.pipeline,
            collection=original.collection,
            model=original.model,
            sampling=state.sampling,
            prompt=wire_messages(state.prompt or prompt),
            chunk_ids=list(original.chunk_ids),
            completion=state.answer,
            citations=result.citations,
            created_at=time.time(),
            draft_of=result.draft_of,
            question=original.question,
            answer=state.answer,
            finish_reason=state.finish_reason,
            sources=original.sources,
        )
        if not state.structured:
            # No guard runs on a draft: its groundedness is unknown, not zero.
            draft.quality = answer_quality(
                groundedness=None, citations=draft.citations, answer_kind="generated", model=draft.model
            )
        # The draft belongs to the conversation's owner, so deleting the conversation deletes it.
        await self.turns.add_turn(principal.tenant, original.user, draft)
        if draft.quality is not None:
            self.quality.observe_answer(principal.tenant, draft.pipeline, draft.quality)
        yield result.done_event(model=result.model, draft_of=result.draft_of)

    async def _run_pipeline(self, run: _Run) -> AsyncIterator[Event]:
        inference, turn, llm, result = run.inference, run.turn, run.llm, run.result
        pipeline = self.pipelines[turn.target]
        ctx = await self.answers.context(pipeline, run.api_key, llm, run.reader, inference)
        state = RunState(
            question=turn.message,
            collection=turn.collection,
            history=run.history,
            options=turn.options,
            form=turn.form,
        )
        result.state = state
        async for event in pipeline.run(state, ctx):
            yield event
        result.take_answer(state)
        result.results = state.results
        result.answer_kind = state.answer_kind
        result.unsupported = state.unsupported
        result.grounding = state.grounding

    async def _run_agent(self, run: _Run) -> AsyncIterator[Event]:
        inference, turn, result = run.inference, run.turn, run.result
        spec = self.agents[turn.target]
        tools: dict[str, Tool] = check_tools(spec, self.tools)
        for name, tool in run.mcp_tools.items():
            tools.setdefault(name, tool)  # a built-in keeps its name
        runner = AgentRunner(
            inference=inference,
            model=run.llm or await self.models.default(inference),
            tools=tools,
            tool_ctx=ToolContext(retrieval=self.upstreams.retrieval(run.api_key), collection=turn.collection),
            max_steps=self.settings.agent_max_steps,
            time_budget_s=self.settings.agent_time_budget_s,
            tool_timeout_s=self.settings.tool_timeout_s,
            max_tokens=self.settings.max_answer_tokens,
            side_effects=spec.side_effects,
            outbound=self.settings.http_tool_enabled,
            named_servers=tuple(turn.mcp_servers),
            approved=turn.approved,
            denied=turn.denied,
            performed=dict(turn.performed),
        )
        result.agent_run = runner
        async for event in runner.run(turn.message, wire_messages(run.history), mode=spec.mode):
            yield event
        result.answer = runner.result.answer
        result.finish_reason = runner.result.finish_reason


async def peek(events: AsyncIterator[Event]) -> tuple[list[Event], AsyncIterator[Event]]:
    """Pulls events until the answer starts, so errors found before then still raise (→ HTTP 4xx);
    returns the buffered events and the rest of the stream."""
    buffered: list[Event] = []
    async for event in events:
        buffered.append(event)
        if event.type in FIRST_OUTPUT:
            break
    return buffered, events


async def collect(events: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in events]


def error_event(exc: BaseException) -> ErrorEvent:
    """The ``error`` event of an exception raised during a turn (with the HTTP status it maps to)."""
    if isinstance(exc, TandemError):
        return ErrorEvent(message=exc.message, code=exc.code or exc.type, status=exc.status_code)
    return ErrorEvent(message=f"internal error: {type(exc).__name__}", code="internal_error")


async def guarded(buffered: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """Buffered events, then the rest; an error raised mid-stream becomes a final error event."""
    for event in buffered:
        yield event
    try:
        async for event in rest:
            yield event
    except Exception as exc:
        yield error_event(exc)
