"""One chat completion of the OpenAI facade: the request read into a turn, and the turn's answer
or stream written back in OpenAI's shape (services/agent/api/openai_compat.py is its route).

``model`` names a pipeline or agent, ``collection`` is an extra field. Citations ride in a
top-level ``citations`` list of the response, and of the last chunk of a stream.

``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` go to the chat
pipeline's generation step as sent (the inference service validates and enforces them), with the
retrieved sources still in the prompt; assistant tool calls and tool results in ``messages`` are
kept in the history, and those after the last user message follow the prompt the pipeline builds.
The model's calls come back in OpenAI's shape (``message.tool_calls``, ``delta.tool_calls``,
``finish_reason: "tool_calls"``). Agents run their own tools and refuse the caller's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from services.agent.chunks import Citation, SearchHit
from services.agent.events import AnswerKind, ErrorEvent, Event, ResetEvent, TokenEvent, ToolCallDeltaEvent
from services.agent.pipelines.state import AnswerForm, TurnOptions
from services.agent.protocol import (
    AnswerCitation,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    CompletionChoice,
    CompletionMessage,
    Message,
    OpenAIModel,
    OpenAIModelList,
    StreamError,
    StreamErrorDetail,
)
from services.agent.runtime import AgentRuntime, Turn, TurnResult, collect, guarded, peek
from services.common.auth import Principal
from services.common.errors import InvalidRequest, TandemError
from services.common.openai_wire import ChatDelta, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta, Usage


def model_list(runtime: AgentRuntime) -> OpenAIModelList:
    return OpenAIModelList(data=[OpenAIModel(id=item["id"], kind=item["kind"]) for item in runtime.catalog()])


def _render_results(hits: list[SearchHit]) -> str:
    lines = []
    for hit in hits:
        passage = (hit.passage.text if hit.passage else "") or hit.text
        lines.append(f"[{hit.index}] {hit.title or hit.document_id}: {passage}")
    return "\n".join(lines) or "No results."


def _citations(result: TurnResult) -> list[AnswerCitation]:
    """The answer's citations, or a search's results as numbered citations."""
    if result.citations or result.results is None:
        return [Citation.model_validate(c) for c in result.citations]
    return [hit.citation() for hit in SearchHit.listed(result.results)]


def _wire(m: Message) -> Message:
    """A history message as the prompt takes it: text content, and the tool fields it has (a
    name only on a tool result)."""
    return Message(
        role=m.role,
        content=m.text(),
        tool_calls=m.tool_calls or None,
        tool_call_id=m.tool_call_id,
        name=m.name if m.role == "tool" else None,
    )


def _split(messages: list[Message]) -> tuple[list[Message], Message, list[Message]]:
    """The history, the question (the last user message) and what follows it: the assistant's
    tool calls and their results, which the model continues from. A tool result must answer a
    call made before it (a 400 naming the message otherwise, as OpenAI does)."""
    asked = [i for i, m in enumerate(messages) if m.role == "user"]
    if not asked:
        raise InvalidRequest("messages need a user message", param="messages")
    last = asked[-1]
    after = messages[last + 1 :]
    if after and (after[-1].role != "tool" or any(m.role not in ("assistant", "tool") for m in after)):
        raise InvalidRequest(
            "the last message must come from the user, or be a tool result after the last user message",
            param="messages",
        )
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            calls.update(c.id for c in m.tool_calls or [])
        elif m.role == "tool":
            if not m.tool_call_id:
                raise InvalidRequest(
                    f"messages[{i}]: a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id"
                )
            if m.tool_call_id not in calls:
                raise InvalidRequest(
                    f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no tool call of an earlier "
                    "assistant message",
                    param=f"messages[{i}].tool_call_id",
                )
    # The pipeline writes its own instructions: the caller's system (developer) messages are not sent.
    history = [_wire(m) for m in messages[:last] if m.role in ("user", "assistant", "tool")]
    return history, messages[last], [_wire(m) for m in after]


def _form(body: ChatCompletionRequest, tail: list[Message]) -> AnswerForm | None:
    form = AnswerForm(
        tools=body.tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format,
        tail=tail,
    )
    return form if form.body() or tail else None


def _check_answer_budget(body: ChatCompletionRequest, window: int) -> None:
    """Answer tokens beyond the model's context window could never be generated: a 400 naming
    the field, as OpenAI and vLLM answer, rather than a silent cut."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(body, name)
        if value is not None and value > window:
            raise InvalidRequest(
                f"{name} {value} is more than the model's context window of {window} tokens",
                param=name,
                code="context_length_exceeded",
            )


def _turn(body: ChatCompletionRequest) -> Turn:
    if body.stream_options is not None and not body.stream:
        # as OpenAI, vLLM and the inference service answer
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    history, question, tail = _split(body.messages)
    options = TurnOptions()
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        options["max_tokens"] = max_tokens
    return Turn(
        target=body.model,
        message=question.text(),
        collection=body.collection,
        conversation_id=body.conversation_id,
        history=history,
        remember=body.conversation_id is not None,
        options=options,
        llm=body.llm,
        form=_form(body, tail),
        mcp_servers=list(body.mcp_servers or []),
    )


def _answer_kind(result: TurnResult) -> AnswerKind | None:
    """A chat pipeline's text answer: "generated", "extractive" or "not_found" (else None)."""
    state = result.state
    if state is None or result.results is not None or state.structured:
        return None
    return result.answer_kind


def _usage(result: TurnResult) -> Usage:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return Usage.model_validate({k: result.usage.get(k, 0) for k in keys})


def _finish_reason(result: TurnResult) -> str:
    if result.tool_calls:
        return "tool_calls"
    if result.error is not None or result.finish_reason == "length":
        return "length"
    return "stop"


def _message(result: TurnResult) -> CompletionMessage:
    if result.tool_calls:
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.function.name, arguments=c.function.arguments))
            for c in result.tool_calls
        ]
        return CompletionMessage(content=result.answer or None, tool_calls=calls)
    return CompletionMessage(
        content=result.answer if result.results is None else _render_results(SearchHit.listed(result.results))
    )


def _tool_call_delta(event: ToolCallDeltaEvent) -> ToolCallDelta:
    """OpenAI's ``delta.tool_calls`` entry: index, then id/type/name on a call's first piece, and
    argument text (only what the inference's own delta had)."""
    # only the fields set reach the JSON (sparse models)
    delta = ToolCallDelta(index=event.index)
    if event.id is not None:
        delta.id, delta.type = event.id, "function"
    function = FunctionDelta()
    if event.name is not None:
        function.name = event.name
    if event.arguments is not None:
        function.arguments = event.arguments
    if function.model_fields_set:
        delta.function = function
    return delta


class OpenAIChat:
    """A chat completion request as a turn of the runtime; bad input raises (→ its 4xx) here,
    before anything is answered."""

    def __init__(
        self, runtime: AgentRuntime, principal: Principal, key: str, body: ChatCompletionRequest
    ) -> None:
        self.runtime, self.principal, self.key, self.body = runtime, principal, key, body
        _check_answer_budget(body, runtime.settings.context_tokens)
        self.turn = _turn(body)
        try:
            runtime.validate(self.turn)
        except TandemError as exc:
            if exc.param == "pipeline":
                exc.param = "model"
            raise
        self.result = TurnResult()
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    def _events(self) -> AsyncIterator[Event]:
        return self.runtime.turn(self.principal, self.key, self.turn, self.result)

    async def answer(self) -> ChatCompletion | ErrorEvent:
        """The whole answer, or the error event of a turn that failed."""
        await collect(self._events())
        result = self.result
        if result.error is not None:
            return result.error
        choice = CompletionChoice(message=_message(result), finish_reason=_finish_reason(result))
        kind = _answer_kind(result)
        completion = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.body.model,
            choices=[choice],
            usage=_usage(result),
            citations=_citations(result),
            message_id=result.message_id,
            conversation_id=result.conversation_id,
        )
        if kind is not None:  # set only for chat pipelines: an unset field stays off the wire
            completion.answer_kind = kind
        return completion

    async def stream(self) -> AsyncIterator[ChatCompletionChunk | StreamError]:
        """Runs the turn up to its first output (errors before it raise), then its chunks."""
        buffered, rest = await peek(self._events())
        return self._chunks(buffered, rest)

    def _chunk(self, delta: ChatDelta, finish: str | None = None) -> ChatCompletionChunk:
        choice = ChunkChoice(delta=delta, finish_reason=finish)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.body.model, choices=[choice])

    def _last_chunk(self) -> ChatCompletionChunk:
        """The finish, with the turn's citations and ids (only this chunk has them: the fields
        set here are the ones written)."""
        result = self.result
        last = self._chunk(ChatDelta(), _finish_reason(result))
        last.citations = _citations(result)
        last.message_id = result.message_id or None
        last.conversation_id = result.conversation_id
        if result.grounding is not None:
            last.kind = result.answer_kind
        if _answer_kind(result) is not None:
            last.answer_kind = result.answer_kind
        if (self.body.stream_options or {}).get("include_usage"):
            # asked for, it is always there (zeros when no model was called, as for a search)
            last.usage = _usage(result)
        return last

    async def _chunks(
        self, buffered: list[Event], rest: AsyncIterator[Event]
    ) -> AsyncIterator[ChatCompletionChunk | StreamError]:
        yield self._chunk(ChatDelta(role="assistant", content=""))
        async for event in guarded(buffered, rest):
            if isinstance(event, TokenEvent):
                yield self._chunk(ChatDelta(content=event.text))
            elif isinstance(event, ToolCallDeltaEvent):
                yield self._chunk(ChatDelta(tool_calls=[_tool_call_delta(event)]))
            elif isinstance(event, ResetEvent):
                # An OpenAI stream cannot take text back: the guard's answer follows on its own
                # paragraph, and the last chunk says kind "extractive".
                yield self._chunk(ChatDelta(content="\n\n"))
            elif isinstance(event, ErrorEvent):
                # The stream ends on its error (then [DONE]), as OpenAI's does: a finish chunk
                # after it would tell a client reading chunks that the cut answer is whole.
                yield StreamError(error=StreamErrorDetail(message=event.message, code=event.code))
                return
        if self.result.results is not None:
            yield self._chunk(ChatDelta(content=_render_results(SearchHit.listed(self.result.results))))
        yield self._last_chunk()
