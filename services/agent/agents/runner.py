"""The agent loop: think, call a tool, observe, repeat, within step and time budgets.

Each step is yielded as an event the moment it happens (``step`` with kind
thought / tool_call / observation / final), and the final answer as ``token``
events, so websocket and SSE clients watch the agent work. Budgets end a run
with an ``error`` event (``step_budget_exceeded`` / ``time_budget_exceeded``);
a tool that raises or hangs becomes an error observation and the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from services.agent.agents import tool_mode
from services.agent.agents.answer_spans import answer_spans
from services.agent.agents.offering import (
    NO_COLLECTION,
    Conditions,
    LeftOut,
    Offer,
    SideEffects,
    offer,
    preference_note,
    readable_collection,
    summary,
)
from services.agent.agents.react import (
    JSON_FAILED_PROMPT,
    JSON_OBSERVATION_PROMPT,
    OBSERVATION_PROMPT,
    REPAIR_PROMPT,
    ReactStep,
    example_turns,
    format_instructions,
    json_example_turns,
    json_instructions,
    json_step,
    json_step_as_text,
    parse_react,
    step_response_format,
)
from services.agent.agents.tool_mode import FINAL_TOOL
from services.agent.clients import ChatRequest, InferenceClient
from services.agent.events import (
    ApprovalRequiredEvent,
    ErrorEvent,
    Event,
    FinalStep,
    ObservationStep,
    ThoughtStep,
    TokenEvent,
    ToolCallStep,
    ToolLeftOut,
    ToolsStep,
)
from services.agent.prompting import tool_result_block
from services.agent.protocol import Sampling
from services.agent.tools.base import (
    Tool,
    ToolContext,
    call_fingerprint,
    call_tool,
    constrained_input,
    has_side_effects,
    tool_needs,
)
from services.common.errors import InvalidRequest
from services.common.openai_wire import ChatCompletion
from services.common.telemetry import set_attributes, span

log = logging.getLogger("tandem.agent.runner")
STOP = ["\nObservation:", "Observation:"]
CONSTRAINED_MIN_TOKENS = 128
DENIED = "error: a person denied this call of {tool!r}; do not call it again, answer without it"


def new_approval_id() -> str:
    return f"apr_{secrets.token_hex(12)}"


@dataclass
class AgentSpec:
    name: str
    description: str
    tools: list[str]
    mode: Literal["react", "openai"] = "react"
    side_effects: SideEffects = "refuse"
    # MCP servers (``server``) or single tools (``server/tool``) of the caller's registered ones
    mcp_servers: list[str] = field(default_factory=list)


@dataclass
class AgentRun:
    answer: str = ""
    steps: int = 0
    tool_calls: int = 0
    repairs: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    # The last model call, exactly (the turn record keeps it): its messages, sampling and raw reply.
    prompt: list[dict[str, Any]] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    completion: str = ""


@dataclass
class _ReactPrompt:
    """What every ReAct step of a run is asked with: the tool names, the tools' own input schemas
    (a pattern or an enum), and the conversation so far (grown by each step)."""

    names: list[str]
    inputs: dict[str, dict[str, Any]]
    messages: list[dict[str, str]]


@dataclass
class AgentRunner:
    inference: InferenceClient
    model: str
    tools: dict[str, Tool]
    tool_ctx: ToolContext
    max_steps: int = 6
    time_budget_s: float = 60.0
    tool_timeout_s: float = 10.0
    max_tokens: int = 256
    max_repairs: int = 2
    # Ask the engine for grammar-constrained steps (response_format json_schema in ReAct mode,
    # tool_choice "required" / a forced final_answer call in tool-calling mode). Off for an upstream
    # that refuses them; the text protocol and its repairs still apply either way.
    constrained: bool = True
    # After a tool result that did not fail, the next step may only finish (constrained to the
    # final-answer form). Small models (SmolLM2-135M) otherwise feed the result back into the tool
    # ("625 * 625") until the budget runs out; multi-hop agents on larger models turn it off.
    finish_after_result: bool = True
    # That forced final answer is a span copied from the tool result (answer_spans.py): the result is
    # then the answer's source by construction. Off for models that should compose their answer.
    copy_answer: bool = True
    side_effects: SideEffects = "refuse"
    # Calls (``call_fingerprint``) a person approved or denied for this run (an approval's re-run).
    approved: frozenset[str] = frozenset()
    denied: frozenset[str] = frozenset()
    # Approved calls already made (by an earlier run of the turn, or earlier in this one) and their
    # results: given again instead of acting twice on one approval. The run adds the calls it makes.
    performed: dict[str, tuple[str, bool]] = field(default_factory=dict)
    approval_id: Callable[[], str] = new_approval_id
    result: AgentRun = field(default_factory=AgentRun)
    # The call the run paused at (side_effects "approve"), once it did.
    paused: ApprovalRequiredEvent | None = None
    # Whether outbound calls are on (the service's TANDEM_AGENT_HTTP_TOOL_ENABLED): a tool that
    # needs them (``http_get``) is offered only then.
    outbound: bool = True
    # The MCP servers the request names: their tools are offered first, and the prompt points at them.
    named_servers: tuple[str, ...] = ()
    # What the run is offered and what was left out, and why (set when the run starts).
    offer: Offer = field(default_factory=lambda: Offer({}))
    conditions: Conditions = field(default_factory=Conditions)

    @property
    def left_out(self) -> list[LeftOut]:
        return self.offer.left_out

    @property
    def withheld(self) -> list[str]:
        """The tools left out for their side effects (``side_effects`` "refuse")."""
        return [lo.tool for lo in self.left_out if lo.cause == "side_effects"]

    async def _offer(self) -> None:
        """Keeps only the tools that can run for this request (agents/offering.py); the trace
        says what was left out and why."""
        with span("agent.tools", named_servers=list(self.named_servers) or None) as current:
            collection, no_collection = None, NO_COLLECTION
            if any("collection" in tool_needs(t) for t in self.tools.values()):
                collection, no_collection = await readable_collection(self.tool_ctx)
            self.conditions = Conditions(
                collection=collection,
                no_collection=no_collection,
                outbound=self.outbound,
                side_effects=self.side_effects,
                named=self.named_servers,
            )
            self.offer = offer(self.tools, self.conditions)
            self.tools = self.offer.tools
            set_attributes(
                current,
                offered=list(self.offer.tools),
                preferred=self.offer.preferred or None,
                left_out=[f"{lo.tool}: {lo.reason}" for lo in self.left_out] or None,
            )

    def _tools_step(self) -> ToolsStep:
        return ToolsStep(
            text=summary(self.offer),
            offered=list(self.offer.tools),
            preferred=self.offer.preferred,
            left_out=[
                ToolLeftOut(tool=lo.tool, reason=lo.reason, **({"server": lo.server} if lo.server else {}))
                for lo in self.left_out
            ],
        )

    async def run(
        self, question: str, history: list[dict[str, str]], mode: str = "react"
    ) -> AsyncIterator[Event]:
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        await self._offer()
        # Sent with the run's first event, not before: a bad request found by the first model call
        # still raises before anything streamed (an HTTP interface answers it with a 4xx).
        pending: list[Event] = [self._tools_step()] if self.offer.notable else []

        async def put(event: Event) -> None:
            while pending:
                await queue.put(pending.pop(0))
            await queue.put(event)

        async def produce() -> None:
            try:
                async with asyncio.timeout(self.time_budget_s):
                    try:
                        loop = self._openai if mode == "openai" else self._react
                        async for event in loop(question, history):
                            await put(event)
                    except InvalidRequest as exc:
                        if not (mode == "openai" and self._tools_refused(exc)):
                            raise
                        # The engine (a remote upstream without tool calling) refused the first
                        # step's tools: the same run in ReAct, which needs plain chat only.
                        log.warning("tool calls refused by the inference service (%s): ReAct instead", exc)
                        self.result = AgentRun()
                        async for event in self._react(question, history):
                            await put(event)
            except TimeoutError:
                self.result.finish_reason = "time_budget"
                await put(
                    ErrorEvent(
                        code="time_budget_exceeded",
                        message=f"the agent used its time budget of {self.time_budget_s:g} s",
                    )
                )
            finally:
                await queue.put(None)

        task = asyncio.create_task(produce())
        try:
            while (event := await queue.get()) is not None:
                yield event
            await task  # re-raises errors of the loop (bad input, upstream failures)
        finally:
            task.cancel()

    def _tools_refused(self, exc: InvalidRequest) -> bool:
        """Whether a 400 is the engine refusing tool calls on the first step (nothing streamed
        yet): it names a tool parameter, or (an upstream's own words, no parameter) tools."""
        first = self.result.steps <= 1 and self.result.tool_calls == 0
        if exc.param is not None:
            return first and exc.param.startswith(("tools", "tool_choice", "parallel_tool_calls"))
        return first and "tool" in exc.message.lower()

    async def _tool(self, name: str, argument: Any) -> AsyncIterator[Event]:
        if has_side_effects(self.tools[name]):
            call = call_fingerprint(name, argument)
            if call in self.denied:
                self._last_ok, self._last_observation = False, DENIED.format(tool=name)
                yield ObservationStep(tool=name, text=self._last_observation, ok=False)
                return
            if call not in self.approved:
                self.paused = ApprovalRequiredEvent(
                    approval_id=self.approval_id(), tool=name, arguments=argument
                )
                self.result.finish_reason = "approval_required"
                yield self.paused
                return
            if call in self.performed:
                self._last_observation, self._last_ok = self.performed[call]
                yield ObservationStep(tool=name, text=self._last_observation, ok=self._last_ok)
                return
        self.result.tool_calls += 1
        started = time.perf_counter()
        observation, ok = await call_tool(self.tools[name], argument, self.tool_ctx, self.tool_timeout_s)
        if has_side_effects(self.tools[name]):
            self.performed[call_fingerprint(name, argument)] = (observation, ok)
        self._last_ok = ok
        yield ObservationStep(
            tool=name, text=observation, ok=ok, seconds=round(time.perf_counter() - started, 3)
        )
        self._last_observation = observation

    async def _complete(self, request: ChatRequest) -> ChatCompletion:
        """One model call, recorded as it was sent (a turn record keeps the last)."""
        self.result.prompt = [dict(m) for m in request.messages]
        self.result.sampling = request.sampling()
        self.result.completion = ""
        return await self.inference.complete(request)

    def _answer_spans(self) -> list[str] | None:
        """What a forced final answer may be: spans of the last good tool result, or None (free)."""
        if not (self.copy_answer and self._last_ok):
            return None
        return answer_spans(self._last_observation) or None

    def _final(self, answer: str) -> list[Event]:
        self.result.answer = answer
        return [FinalStep(text=answer), TokenEvent(text=answer)]

    def _forced(self, step: int) -> bool:
        """Whether this step may only finish: the budget's last, or (``finish_after_result``) the
        one after a good tool result. With a constrained engine it is always a final answer."""
        return step > 1 and (step == self.max_steps or (self.finish_after_result and self._last_ok))

    def _react_prompt(self, question: str, history: list[dict[str, str]]) -> _ReactPrompt:
        described = {n: t.description for n, t in self.tools.items()}
        instructions = json_instructions(described) if self.constrained else format_instructions(described)
        if note := preference_note(self.offer, self.conditions):
            instructions += "\n" + note
        examples = json_example_turns(described) if self.constrained else example_turns(described)
        return _ReactPrompt(
            names=list(self.tools),
            inputs={
                n: s for n, t in self.tools.items() if (s := constrained_input(t.parameters)) is not None
            },
            messages=[
                {"role": "system", "content": instructions},
                *examples,
                *history,
                {"role": "user", "content": f"Question: {question}"},
            ],
        )

    def _named_first(self, step: int) -> list[str]:
        """The tools the first step may only call: the named servers' (empty: no server named).
        A request that names a server asks for it; a small model otherwise follows the worked
        example's tool (``named_server`` benchmark: the calculator for "42 kilometres in miles")."""
        return self.offer.preferred if step == 1 else []

    async def _react_reply(self, prompt: _ReactPrompt, step: int, forced: bool) -> tuple[str, ReactStep]:
        """One ReAct step of the model: its raw text and the step parsed (with repairs)."""
        request = ChatRequest(
            model=self.model, messages=prompt.messages, max_tokens=self.max_tokens, temperature=0.0
        )
        if self.constrained:
            # the JSON step must be able to close: its bounded strings plus the keys need this many tokens
            request.max_tokens = max(self.max_tokens, CONSTRAINED_MIN_TOKENS)
            # no stop strings: the grammar ends the step, and a stop inside a JSON string would break it
            named = self._named_first(step)
            request.response_format = step_response_format(
                named or prompt.names,
                final_only=forced,
                answers=self._answer_spans() if forced else None,
                inputs=prompt.inputs,
                act_only=bool(named),
            )
        else:
            request.stop = STOP
        text = (await self._complete(request)).message.content or ""
        self.result.completion = text
        as_text = json_step_as_text(text) if self.constrained else None
        return text, parse_react(as_text if as_text is not None else text, prompt.names)

    def _repeats(self, parsed: ReactStep, last_call: tuple[str, str] | None) -> bool:
        """The same call again right after its answer, or the answer itself fed back as a new
        input: small models loop here instead of finishing."""
        return self._last_ok and (
            (parsed.tool, parsed.argument) == last_call
            or parsed.argument.strip() == self._last_observation.strip()
        )

    async def _react_action(self, step: int, parsed: ReactStep, prompt: _ReactPrompt) -> AsyncIterator[Event]:
        """The step's tool call and its observation; the model then sees both."""
        yield ToolCallStep(step=step, tool=parsed.tool, input=parsed.argument, repairs=parsed.repairs)
        async for event in self._tool(parsed.tool, parsed.argument):
            yield event
        if self.paused is not None:
            return
        # The model sees its step rewritten in the strict format: small models copy what they see.
        canonical = (
            json_step(parsed.thought, parsed.tool, parsed.argument)
            if self.constrained
            else (f"Thought: {parsed.thought}\n" if parsed.thought else "")
            + f"Action: {parsed.tool}\nAction Input: {parsed.argument}"
        )
        # a failed tool is not the answer's source: say so, or the model repeats the error
        if not self.constrained:
            template = OBSERVATION_PROMPT
        else:
            template = JSON_OBSERVATION_PROMPT if self._last_ok else JSON_FAILED_PROMPT
        prompt.messages += [
            {"role": "assistant", "content": canonical},
            {
                "role": "user",
                "content": template.format(
                    observation=tool_result_block(parsed.tool, self._last_observation)
                ),
            },
        ]

    async def _react(self, question: str, history: list[dict[str, str]]) -> AsyncIterator[Event]:
        prompt = self._react_prompt(question, history)
        repairs_left = self.max_repairs
        last_call: tuple[str, str] | None = None
        for step in range(1, self.max_steps + 1):
            self.result.steps = step
            forced = self._forced(step)
            text, parsed = await self._react_reply(prompt, step, forced)
            if forced and parsed.kind != "final":
                break
            self.result.repairs.extend(parsed.repairs)
            if parsed.thought and parsed.kind != "invalid":
                yield ThoughtStep(step=step, text=parsed.thought)
            if parsed.kind == "final":
                for event in self._final(parsed.answer):
                    yield event
                return
            if parsed.kind == "action" and self._repeats(parsed, last_call):
                # The observation already answers it: take it as the final answer.
                self.result.repairs.append("repeated call: its last observation taken as the final answer")
                for event in self._final(self._last_observation):
                    yield event
                return
            if parsed.kind == "action":
                last_call = (parsed.tool, parsed.argument)
                async for event in self._react_action(step, parsed, prompt):
                    yield event
                if self.paused is not None:
                    return
                continue
            # Invalid: ask for the format again, a bounded number of times; then take plain text as the answer.
            if repairs_left > 0 and step < self.max_steps:
                repairs_left -= 1
                yield ThoughtStep(step=step, text=text.strip(), error=parsed.error)
                prompt.messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": REPAIR_PROMPT.format(error=parsed.error)},
                ]
                continue
            if text.strip() and not parsed.tool:
                self.result.repairs.append("plain reply taken as the final answer")
                for event in self._final(text.strip()):
                    yield event
                return
        self.result.finish_reason = "step_budget"
        yield self._step_budget_exceeded()

    def _call_request(
        self, step: int, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> tuple[ChatRequest, list[str] | None]:
        """One tool-calling step's request, and the spans its answer must be one of (None: free)."""
        request = ChatRequest(model=self.model, messages=messages, max_tokens=self.max_tokens)
        if not self.constrained:
            request.tools = tools
            return request, None
        request.temperature = 0.0
        request.max_tokens = max(self.max_tokens, CONSTRAINED_MIN_TOKENS)
        forced = self._forced(step)
        spans = self._answer_spans() if forced else None
        if spans:
            # The answer copied from the result: the final_answer call's shape as the response
            # format, without tools (a listed enum of spans would fill the prompt).
            request.response_format = tool_mode.final_call_format(spans)
            return request, spans
        # forced: only final_answer listed, so the prompt shows no other call to imitate
        named = self._named_first(step)
        request.tools = (
            [tool_mode.FINAL_FUNCTION]
            if forced
            else [t for t in tools if t["function"]["name"] in named] or tools
        )
        request.tool_choice = {"type": "function", "function": {"name": FINAL_TOOL}} if forced else "required"
        # one call a step: an array of calls lets a small model run on with invented calls
        # until max_tokens cuts the JSON (the engine then returns it as plain content)
        request.parallel_tool_calls = False
        return request, None

    async def _openai(self, question: str, history: list[dict[str, str]]) -> AsyncIterator[Event]:
        tools = tool_mode.functions(self.tools)
        if self.constrained:
            # Finishing is itself a (constrained) call, so tool_choice "required" never traps the model.
            tools.append(tool_mode.FINAL_FUNCTION)
        note = preference_note(self.offer, self.conditions)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": tool_mode.SYSTEM_PROMPT + (f" {note}" if note else "")},
            *(tool_mode.example_turns(self.tools) if self.constrained else []),
            *history,
            {"role": "user", "content": question},
        ]
        for step in range(1, self.max_steps + 1):
            self.result.steps = step
            request, spans = self._call_request(step, messages, tools)
            resp = await self._complete(request)
            message = resp.message
            self.result.completion = message.content or ""
            calls = message.tool_calls or []
            final_call = next((c for c in calls if c.function.name == FINAL_TOOL), None)
            answer = tool_mode.final_call_answer(message.content) if spans else None
            if final_call is not None:
                answer = tool_mode.call_answer(final_call.function.arguments)
            if answer is not None:
                for event in self._final(answer or self._last_observation):
                    yield event
                return
            if not calls:
                for event in self._final((message.content or "").strip()):
                    yield event
                return
            if message.content:
                yield ThoughtStep(step=step, text=message.content)
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [c.model_dump(exclude_none=True) for c in calls],
                }
            )
            for call in calls:
                name = call.function.name
                try:
                    args = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    args = call.function.arguments
                yield ToolCallStep(step=step, tool=name, input=args)
                if name not in self.tools:
                    self._last_ok = False
                    self._last_observation = f"error: unknown tool {name!r}"
                    yield ObservationStep(tool=name, text=self._last_observation, ok=False)
                else:
                    async for event in self._tool(name, args):
                        yield event
                    if self.paused is not None:
                        return
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id or name,
                        "content": tool_result_block(name, self._last_observation),
                    }
                )
            if self.constrained:
                # The result as the answer's source, right before the (forced) final_answer call.
                messages.append(
                    {
                        "role": "user",
                        "content": tool_mode.result_prompt(
                            calls[-1].function.name, self._last_observation, question, self._last_ok
                        ),
                    }
                )
        self.result.finish_reason = "step_budget"
        yield self._step_budget_exceeded()

    def _step_budget_exceeded(self) -> ErrorEvent:
        return ErrorEvent(
            code="step_budget_exceeded",
            message=f"the agent used its {self.max_steps} steps without a final answer",
        )

    _last_observation: str = ""
    _last_ok: bool = False


def check_tools(spec: AgentSpec, tools: dict[str, Tool]) -> dict[str, Tool]:
    missing = [t for t in spec.tools if t not in tools]
    if missing:
        raise InvalidRequest(f"agent {spec.name!r} needs tools that are not available: {missing}")
    return {t: tools[t] for t in spec.tools}
