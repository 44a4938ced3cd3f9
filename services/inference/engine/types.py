"""Engine-level data types: sampling parameters, requests, streamed events, outputs, errors.

These are plain dataclasses (no pydantic, no FastAPI) so the engine stays a library
the trainer can import for its rollouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "timeout", "error"]


class EngineError(Exception):
    """Base of the engine's errors; the HTTP edge maps each subclass to a status code."""


class InvalidParams(EngineError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(InvalidParams):
    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message, param="messages")
        self.limit = limit


class QueueFull(EngineError):
    """No room to wait: ``code`` is ``queue_full`` (the global queue) or
    ``rate_limit_exceeded`` (the caller tenant's own share is used up)."""

    def __init__(self, message: str, retry_after: float = 1.0, code: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.code = code


class UnknownModel(EngineError):
    pass


class AdapterError(EngineError):
    """An adapter path that is not an adapter, or does not fit the base model."""


class EngineUnavailable(EngineError):
    pass


class UpstreamFailure(EngineError):
    """A remote engine answered with an error or could not be reached."""

    def __init__(self, message: str, status_code: int = 502, body: dict | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


@dataclass(frozen=True)
class GuidedDecoding:
    """A grammar the output must follow: exactly one of ``json_schema`` (JSON text; the
    OpenAI ``json_object`` mode is the schema ``{"type": "object"}``) or ``grammar`` (EBNF,
    a vLLM-style extension). ``param`` names the request field errors are reported on."""

    json_schema: str | None = None
    grammar: str | None = None
    param: str = "response_format"


SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy; ``top_k <= 0`` and ``top_p == 1`` are off.

    ``max_tokens=None`` means up to the context length. ``logprobs`` is None (none), 0 (the
    sampled token's only) or k (plus the k most likely); the engine always records the sampled
    token's log-probability under the model's raw distribution (temperature 1, no filtering,
    as vLLM's default), which is what ``GenerationOutput.logprobs`` holds.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Set False to skip incremental detokenisation when only token ids are wanted (rollouts).
    detokenize: bool = True
    # Logit processors (OpenAI/vLLM semantics); at their defaults they are skipped entirely,
    # so greedy output stays identical to ``transformers``' generate.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    guided: GuidedDecoding | None = None

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether any logit processor runs for this request (the fast path skips them)."""
        return self.penalized or bool(self.logit_bias)

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise InvalidParams(
                f"temperature must be between 0 and 100, got {self.temperature}", "temperature"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidParams(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidParams(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParams(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.n < 1 or self.n > 64:
            raise InvalidParams(f"n must be between 1 and 64, got {self.n}", "n")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidParams(
                f"logprobs/top_logprobs must be between 0 and 20, got {self.logprobs}", "logprobs"
            )
        if any(not s for s in self.stop):
            raise InvalidParams("stop strings must not be empty", "stop")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidParams(f"seed must fit in 64 bits, got {self.seed}", "seed")
        bad = [t for t in self.stop_token_ids if t < 0]
        if bad:
            raise InvalidParams(f"stop_token_ids must not be negative, got {bad[:5]}", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidParams(f"{name} must be between -2 and 2, got {value}", name)
        if not 0.0 < self.repetition_penalty < float("inf"):  # vLLM's rule: any positive number
            raise InvalidParams(
                f"repetition_penalty must be a positive number, got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParams(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for token, bias in self.logit_bias.items():
            if token < 0:
                raise InvalidParams(f"logit_bias: token id {token} is negative", "logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidParams(
                    f"logit_bias: the bias of token {token} must be between -100 and 100, got {bias}",
                    "logit_bias",
                )

    def check_vocab(self, vocab: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidParams(
                f"stop_token_ids out of the vocabulary [0, {vocab}): {bad[:5]}", "stop_token_ids"
            )
        bad = [t for t in self.logit_bias if t >= vocab]
        if bad:
            raise InvalidParams(
                f"logit_bias: token ids out of the vocabulary [0, {vocab}): {bad[:5]}", "logit_bias"
            )


@dataclass
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class StreamEvent:
    """What one sequence (choice ``index``) produced in one scheduler step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # tool-call deltas in OpenAI's chunk shape, from an upstream that parsed calls itself (remote)
    tool_calls: list[dict] | None = None
    # on a sequence's first token, for engines that know it: seconds it waited for a batch slot
    queued_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """One finished sequence (the contract the trainer's rollouts use)."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""


@dataclass(frozen=True)
class ContentPart:
    """One part of a message's content, OpenAI's ``{"type": "text", "text": ...}``. Only text
    parts render into a prompt; another kind (an image) is refused there, and reaches a remote
    engine's upstream in the client's own body (``EngineRequest.extra``)."""

    type: str
    text: str = ""


@dataclass(frozen=True)
class MessageToolCall:
    """A call an earlier assistant message made, OpenAI's ``{"id", "type", "function": {"name",
    "arguments"}}``. ``arguments`` is JSON text as OpenAI sends it; an object (as some clients
    send) is taken as it is."""

    name: str | None
    arguments: Any
    id: str | None = None
    type: str = "function"

    def openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        out = {"id": self.id, "type": self.type, "function": fn}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class PromptMessage:
    """A chat message as the engine renders it into a prompt (services/inference/engine/tools.py
    turns a list of them into the chat template's input)."""

    role: str
    content: str | tuple[ContentPart, ...] | None = None
    name: str | None = None
    tool_calls: tuple[MessageToolCall, ...] | None = None
    tool_call_id: str | None = None

    @classmethod
    def from_openai(cls, raw: object, index: int) -> PromptMessage:
        """``messages[index]`` of an OpenAI request body (a library caller's, or the validated
        wire model's), with the errors the API reports on a malformed one."""
        if not isinstance(raw, Mapping) or "role" not in raw:
            raise InvalidParams(f"messages[{index}] must be an object with a role", "messages")
        content = raw.get("content")
        parts: str | tuple[ContentPart, ...] | None
        if content is None or isinstance(content, str):
            parts = content
        elif isinstance(content, list):
            parts = tuple(_content_part(part) for part in content)
        else:
            raise InvalidParams(
                f"message content must be a string or a list of parts, got {type(content).__name__}",
                "messages",
            )
        calls = raw.get("tool_calls")
        return cls(
            role=raw["role"],
            content=parts,
            name=raw.get("name"),
            tool_calls=tuple(_tool_call(c) for c in calls) if calls is not None else None,
            tool_call_id=raw.get("tool_call_id"),
        )

    def text(self) -> str:
        """The content as the prompt's text: text parts joined."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" for p in self.content):
            raise InvalidParams("only text content parts are supported", "messages")
        return "".join(p.text for p in self.content)

    def openai(self) -> dict[str, Any]:
        """The message in an OpenAI request body (what a remote engine forwards)."""
        content: str | list[dict[str, str]] | None = (
            self.content
            if self.content is None or isinstance(self.content, str)
            else [
                {"type": p.type, "text": p.text} if p.type == "text" else {"type": p.type}
                for p in self.content
            ]
        )
        out = {
            "role": self.role,
            "content": content,
            "name": self.name,
            "tool_calls": [c.openai() for c in self.tool_calls] if self.tool_calls is not None else None,
            "tool_call_id": self.tool_call_id,
        }
        return {k: v for k, v in out.items() if v is not None}


def _content_part(part: object) -> ContentPart:
    if isinstance(part, str):
        return ContentPart("text", part)
    if isinstance(part, Mapping):
        kind = part.get("type")
        return ContentPart("text", str(part.get("text", ""))) if kind == "text" else ContentPart(str(kind))
    raise InvalidParams("only text content parts are supported", "messages")


def _tool_call(raw: object) -> MessageToolCall:
    if not isinstance(raw, Mapping):
        raise InvalidParams("tool_calls must be a list of objects", "messages")
    # the function's fields, also read from the call itself (a flat {"name", "arguments"})
    found = raw.get("function", raw)
    fn: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    return MessageToolCall(fn.get("name"), fn.get("arguments"), raw.get("id"), raw.get("type", "function"))


@dataclass
class EngineRequest:
    """A request as the serving layer hands it to an engine.

    Exactly one of ``messages`` (chat), ``prompt`` (text) or ``prompt_token_ids`` is set.
    ``model`` is the served name the client asked for (base model, adapter or registered
    model); engines that serve adapters pick the adapter by it.
    """

    request_id: str
    params: SamplingParams
    model: str | None = None
    messages: list[PromptMessage] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    timeout: float | None = None
    # chat: OpenAI tool definitions to render into the prompt (chat template or fallback)
    tools: list[dict] | None = None
    # completions: return the prompt before the completion / fill in the middle before ``suffix``
    echo: bool = False
    suffix: str | None = None
    # the caller's tenant (authenticated principal): the torch engine shares slots and queue
    # fairly between tenants; None is the default tenant
    tenant: str | None = None
    # for `remote`: the raw OpenAI body fields to forward (extensions such as top_k)
    extra: dict = field(default_factory=dict)
