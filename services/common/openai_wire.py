"""OpenAI's response objects (chat and text completions, their stream chunks, model lists,
embeddings), one set for the services that write them and the clients that read them: the
inference service and the agent's facade answer with them; services/common/openai_client.py,
the agent's inference client and the remote engine read any compatible upstream's answer into
them (services/common/openai_stream.py reads the streams).

Written, a model is OpenAI's JSON to the key: every field, ``null`` included, except those a
:class:`SparseModel` leaves out until given. Read, it is lenient, since the upstream may be
Tandem, vLLM, OpenAI or another compatible server: most fields have a default, and fields it
does not model are kept (and written back as they came). Requests are each service's own."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from services.common.bounds import NAME_CHARS, TEXT_CHARS


class WireModel(BaseModel):
    """A response model: every field is in the JSON, ``null`` included, as OpenAI sends it."""


class SparseModel(WireModel):
    """A response model whose fields named in ``_omit_unset`` stay out of the JSON unless they
    were given: a stream delta carries only what changed, and ``usage`` is in every chunk only
    with ``stream_options.include_usage``. (A serializer of its own costs a Python call per
    instance, so only these models have one, not the many logprob entries.)"""

    _omit_unset: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in self._omit_unset - self.model_fields_set:
            data.pop(name, None)
        return data


class _Open(WireModel):
    # an upstream's own fields are kept, and pass through as they came (remote engine); the
    # OpenAPI schema has every field required, as every one is in the JSON written
    model_config = ConfigDict(extra="allow", json_schema_serialization_defaults_required=True)


class _OpenSparse(SparseModel):
    model_config = ConfigDict(extra="allow")


def _fixed(value: str, *others: str, max_length: int | None = None) -> Any:
    """A field whose value OpenAI fixes (or Tandem's few): read as any string, so that a server
    that says otherwise is still understood, and documented as the value(s) written;
    ``max_length`` where a request also carries it."""
    extra: dict[str, Any] = {"enum": [value, *others]} if others else {"const": value}
    return Field(value, max_length=max_length, json_schema_extra=extra)


class Usage(_Open):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class FunctionCall(_Open):
    name: str = Field(default="", max_length=NAME_CHARS)
    arguments: str = Field(default="", max_length=TEXT_CHARS, description="The arguments as JSON text.")


class ToolCall(_Open):
    """A call a model made, OpenAI's ``{"id", "type": "function", "function": {"name",
    "arguments"}}``: in a chat completion's message, in a history a client sends back (the
    agent's requests bound it with these limits), and as the engines' tool-call parsers
    return it. Tandem's ids are ``call_`` and 24 hex digits."""

    id: str = Field(default="", max_length=NAME_CHARS)
    type: str = _fixed("function", max_length=NAME_CHARS)
    function: FunctionCall = Field(default_factory=FunctionCall)

    @classmethod
    def of(cls, name: str, arguments: str, call_id: str = "") -> ToolCall:
        """A call of ``name`` with ``arguments`` (JSON text), given a fresh id unless it has one."""
        return cls(
            id=call_id or f"call_{uuid.uuid4().hex[:24]}",
            function=FunctionCall(name=name, arguments=arguments),
        )


class FunctionDelta(_OpenSparse):
    name: str | None = None
    arguments: str | None = None
    _omit_unset = frozenset({"name", "arguments"})


class ToolCallDelta(_OpenSparse):
    """One streamed piece of a tool call: the first carries ``id``, ``type`` and the name,
    the later ones argument fragments (OpenAI's chunk shape); ``index`` is in every one."""

    index: int = 0
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None
    _omit_unset = frozenset({"id", "type", "function"})


class ChatDelta(_OpenSparse):
    """What one chunk adds to a choice: the role first, then content or tool-call pieces."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    _omit_unset = frozenset({"role", "content", "tool_calls"})


# -- log-probabilities ---------------------------------------------------------------------------


class TopLogprob(_Open):
    """A token and its log-probability (one of the likeliest at a position, or the one chosen)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(_Open):
    content: list[ChatTokenLogprob] | None = None
    refusal: str | None = None


class CompletionLogprobs(_Open):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


# -- choices -------------------------------------------------------------------------------------


class ChatCompletionMessage(_Open):
    """The answer of a ``chat.completion``: ``content`` is null when it is tool calls."""

    role: str = _fixed("assistant")
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Open):
    """One answer of a ``chat.completion``; one that made tool calls ends ``tool_calls``."""

    index: int = 0
    message: ChatCompletionMessage = Field(default_factory=ChatCompletionMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(_Open):
    """One choice's piece of a ``chat.completion.chunk``: ``finish_reason`` is set on its last."""

    index: int = 0
    delta: ChatDelta = Field(default_factory=ChatDelta)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return self.delta.content or ""


class CompletionChoice(_Open):
    """A choice of a text completion or chunk; with several prompts, ``index`` is
    prompt * n + choice."""

    index: int = 0
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


# -- envelopes -----------------------------------------------------------------------------------


class _Completion(_OpenSparse):
    # field order is the JSON's: each subclass sets its own ``object`` in place
    id: str = ""
    object: str = ""
    created: int = 0
    model: str = ""
    system_fingerprint: str | None = None


class ChatCompletion(_Completion):
    object: str = _fixed("chat.completion")
    choices: list[ChatChoice] = []
    usage: Usage | None = None

    @property
    def message(self) -> ChatCompletionMessage:
        """The first choice's message (an empty one when there is no choice)."""
        return self.choices[0].message if self.choices else ChatCompletionMessage()


class ChatCompletionChunk(_Completion):
    """A piece of a streamed chat completion: ``usage`` is left out unless
    ``stream_options.include_usage`` asks for it (then null until the last chunk)."""

    object: str = _fixed("chat.completion.chunk")
    choices: list[ChatChunkChoice] = []
    usage: Usage | None = None
    _omit_unset = frozenset({"usage"})

    def has_output(self) -> bool:
        """Anything beyond the opening role chunk: text, a call, a finish or the usage."""
        return self.usage is not None or any(
            c.text or c.delta.tool_calls or c.finish_reason or c.logprobs for c in self.choices
        )


class TextCompletion(_Completion):
    """A text completion, and (OpenAI's way) each chunk of a streamed one: ``usage`` is left
    out of chunks unless ``stream_options.include_usage`` asks for it."""

    object: str = _fixed("text_completion")
    choices: list[CompletionChoice] = []
    usage: Usage | None = None
    _omit_unset = frozenset({"usage"})

    def has_output(self) -> bool:
        return self.usage is not None or any(c.text or c.finish_reason or c.logprobs for c in self.choices)


# -- models and embeddings -----------------------------------------------------------------------


class ModelCard(_Open):
    id: str
    object: str = _fixed("model")
    created: int = 0
    owned_by: str | None = "tandem"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # Tandem's; an adapter's base model is its ``parent``
    kind: str | None = _fixed("base", "adapter", "registered", "embedding", "rerank")
    # Embedding models: the vector size (/v1/embeddings); none for generative models.
    dimensions: int | None = None


class ModelList(_Open):
    object: str = _fixed("list")
    data: list[ModelCard] = []


class Embedding(_Open):
    index: int
    embedding: list[float]


class RerankScore(_Open):
    index: int
    relevance_score: float


class RerankList(_Open):
    """``/v1/rerank``'s answer (vLLM's and Jina's shape)."""

    results: list[RerankScore] = []

    def scores(self, count: int) -> list[float]:
        """One score per document, in the documents' order; ValueError unless each of ``count``
        documents was scored once."""
        if sorted(r.index for r in self.results) != list(range(count)):
            raise ValueError(f"the reranker did not score each of the {count} documents once")
        return [r.relevance_score for r in sorted(self.results, key=lambda r: r.index)]


class EmbeddingList(_Open):
    """``/v1/embeddings``'s answer (float vectors)."""

    data: list[Embedding] = []

    def vectors(self) -> list[list[float]]:
        """One vector per input, in the inputs' order."""
        return [e.embedding for e in sorted(self.data, key=lambda e: e.index)]
