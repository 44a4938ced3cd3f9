"""Pipeline components. Each node type wraps one small piece behind a protocol.

A node is built from its definition's ``params`` (validated by the node's own
``Params`` model: an unknown or ill-typed parameter is a definition error naming
it) and runs as an async generator over the shared ``RunState``, yielding any
events it produces (tokens, citations) as they happen.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from services.agent.chunks import Chunk, Citation
from services.agent.citations import CitationTracker, attribute
from services.agent.clients import ChatRequest, StreamOptions
from services.agent.events import CitationEvent, ResetEvent, TokenEvent, ToolCallDeltaEvent
from services.agent.grounding import (
    MIN_SIMILARITY,
    GroundingReport,
    check,
    with_embeddings,
)
from services.agent.highlight import highlight
from services.agent.prompting import BudgetPromptBuilder, PromptPlan, PromptTooLong
from services.agent.protocol import Message, Sampling, wire_messages
from services.agent.reader import answer_text, read
from services.agent.reader.features import FEATURES_READER, FeatureScorer, shipped_model
from services.agent.reader.question import embedded_text
from services.agent.reader.rules import RuleScorer
from services.agent.reader.scorer import AnswerScorer, ReaderScorer
from services.agent.reader.select import Selection, not_found_text, with_neighbours
from services.agent.reader.similarity import Similarity, by_embedding, with_known
from services.agent.repetition import RepetitionGuard
from services.agent.rewrite import HistoryRewriter, QueryRewriter
from services.common.candidates import answer_candidates
from services.common.errors import InvalidRequest, TandemError
from services.common.jsonsafe import JsonObject
from services.common.openai_wire import ToolCallDelta
from services.common.text import content_terms, overlap

from .state import AnswerKind, EventStream, RunContext, RunState, Sockets

log = logging.getLogger("tandem.agent.guard")

NO_CONTEXT_ANSWER = "I don't know: nothing in the collection {collection!r} is relevant to this question."


# -- the protocols the nodes are built on ------------------------------------------------------


class Retriever(Protocol):
    async def retrieve(
        self, ctx: RunContext, collection: str, query: str, top_k: int | None = None, reader: str = ""
    ) -> list[Chunk]:
        """Up to ``top_k`` chunks (None: the retriever's own default). ``reader``: the question as
        the answer step embeds it, for a retriever that scores the hits' sentences against it."""
        ...


class Reranker(Protocol):
    def rerank(self, query: str, chunks: list[Chunk]) -> list[Chunk]: ...


class PromptBuilder(Protocol):
    def build(
        self, question: str, history: list[Message], chunks: list[Chunk], tail: Sequence[Message] = ()
    ) -> PromptPlan:
        """``tail``: messages after the question (the caller's tool calls and results)."""
        ...


class Generator(Protocol):
    def generate(self, ctx: RunContext, messages: list[Message]) -> AsyncIterator[str | ToolCallDelta]:
        """Answer text as it streams; a piece of a tool call when the caller offered tools."""
        ...


class Component(Protocol):
    # What the component needs, reads and writes of the run state (checked: see state.Sockets).
    @property
    def sockets(self) -> Sockets: ...

    def run(self, state: RunState, ctx: RunContext) -> EventStream:
        """The component's events (an async generator): it reads and writes ``state``."""
        ...


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- implementations of the protocols ---------------------------------------------------------


class ServiceRetriever:
    """Hybrid (or dense / sparse) search through the retrieval service."""

    def __init__(
        self,
        top_k: int | None,
        mode: str,
        rerank: bool,
        section_tokens: int | None = None,
        sentences: bool = False,
    ) -> None:
        self.top_k = top_k
        self.mode = mode
        self.rerank = rerank
        self.section_tokens = section_tokens
        self.sentences = sentences

    async def retrieve(
        self, ctx: RunContext, collection: str, query: str, top_k: int | None = None, reader: str = ""
    ) -> list[Chunk]:
        hits = await ctx.retrieval.search(
            collection,
            query,
            top_k=top_k or self.top_k or ctx.settings.top_k,
            mode=self.mode,
            rerank=self.rerank,
            section_tokens=self.section_tokens,
            sentence_query=(reader or query) if self.sentences else None,
        )
        return distinct_passages(hits) if self.section_tokens else hits


def distinct_passages(chunks: list[Chunk]) -> list[Chunk]:
    """``chunks`` (best first) without those whose text overlaps a better one's in the same
    document: two hits of one section read as one passage, not the same text twice."""
    kept: list[Chunk] = []
    for c in chunks:
        if not any(k.document_id == c.document_id and c.start < k.end and k.start < c.end for k in kept):
            kept.append(c)
    return kept


class OverlapReranker:
    """Re-orders by a blend of the retrieval rank and query-word coverage; cheap, runs in the agent.

    Hybrid fusion scores are ranks, not relevance: a chunk that contains every
    query word beats one that only shares a topic. The cross-encoder reranker of
    the retrieval service (``retriever.rerank: true``) is the heavier alternative.
    """

    def __init__(self, weight: float = 0.5) -> None:
        self.weight = weight

    def rerank(self, query: str, chunks: list[Chunk]) -> list[Chunk]:
        terms = content_terms(query)
        n = max(len(chunks), 1)
        scored = []
        for rank, chunk in enumerate(chunks):
            lexical = overlap(terms, chunk.text + " " + chunk.title)
            scored.append((self.weight * lexical + (1 - self.weight) * (1 - rank / n), -rank, chunk))
        scored.sort(key=lambda t: (t[0], t[1]), reverse=True)
        return [c for _, _, c in scored]


class InferenceGenerator:
    """Streams answer text from the inference service's chat completions."""

    def __init__(
        self,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None = None,
        extra: JsonObject | None = None,
    ) -> None:
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.extra = dict(extra or {})
        self.usage: dict[str, int] = {}
        self.finish_reason = "stop"

    def sampling(self, ctx: RunContext) -> Sampling:
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens or ctx.settings.max_answer_tokens,
            "temperature": ctx.settings.temperature if self.temperature is None else self.temperature,
        }
        top_p = ctx.settings.top_p if self.top_p is None else self.top_p
        if top_p is not None and top_p < 1.0:
            out["top_p"] = top_p
        # Passed through as is: the inference service validates them (an unknown one is its 4xx).
        return Sampling.model_validate({**out, **self.extra})

    def request(self, ctx: RunContext, messages: list[Message]) -> ChatRequest:
        """The request of an answer to ``messages``: :meth:`sampling`'s, and the usage asked for
        (in the stream's last chunk)."""
        return ChatRequest(
            model=ctx.model,
            messages=wire_messages(messages),
            **self.sampling(ctx).model_dump(exclude_unset=True),
            stream_options=StreamOptions(include_usage=True),
        )

    async def generate(self, ctx: RunContext, messages: list[Message]) -> AsyncIterator[str | ToolCallDelta]:
        async for chunk in ctx.inference.stream(self.request(ctx, messages)):
            if chunk.usage is not None:
                self.usage = {k: v for k, v in chunk.usage.model_dump().items() if isinstance(v, int)}
            for choice in chunk.choices:
                if choice.finish_reason:
                    self.finish_reason = choice.finish_reason
                if choice.text:
                    yield choice.text
                for delta in choice.delta.tool_calls or []:
                    yield delta


# -- nodes ---------------------------------------------------------------------------------------


class RewriteNode:
    sockets: ClassVar[Sockets] = Sockets.of(writes=("search_query",))

    class P(Params):
        max_turns: int = Field(2, ge=1, le=20)

    def __init__(self, p: P, rewriter: QueryRewriter | None = None) -> None:
        self.rewriter = rewriter or HistoryRewriter(max_turns=p.max_turns)

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        state.search_query = await self.rewriter.rewrite(state.question, state.history)
        return
        yield


class RetrieveNode:
    sockets: ClassVar[Sockets] = Sockets.of(reads=("search_query",), writes=("chunks",))

    class P(Params):
        top_k: int | None = Field(None, ge=1, le=100)
        mode: Literal["dense", "sparse", "hybrid"] = "hybrid"
        rerank: bool = False
        fetch_titles: bool = True
        # What the model and the answer step read of each hit: its enclosing section, at most this
        # many tokens around it (None: the chunk alone). Small chunks rank; sections answer.
        section_tokens: int | None = Field(None, ge=16, le=8192)
        # Each hit's candidate answer sentences scored by retrieval against the query (its
        # embedder is in that process): the answer step then embeds nothing itself.
        sentences: bool = False

    def __init__(self, p: P, retriever: Retriever | None = None) -> None:
        self.p = p
        self.retriever = retriever or ServiceRetriever(
            p.top_k, p.mode, p.rerank, p.section_tokens, p.sentences
        )

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        if not state.collection:
            raise InvalidRequest("this pipeline needs a 'collection'", param="collection")
        query = state.search_query or state.question
        top_k = state.options.get("top_k")
        # A per-request top_k reaches any retriever through the protocol.
        state.chunks = await self.retriever.retrieve(
            ctx,
            state.collection,
            query,
            top_k=top_k if isinstance(top_k, int) else None,
            reader=embedded_question(state),
        )
        if self.p.fetch_titles:
            missing = [c.document_id for c in state.chunks if not c.title]
            if missing:
                titles = await ctx.retrieval.document_titles(state.collection, missing)
                for c in state.chunks:
                    c.title = c.title or titles.get(c.document_id, "")
        return
        yield


class RerankNode:
    sockets: ClassVar[Sockets] = Sockets.of(needs=("chunks",), reads=("search_query",), writes=("chunks",))

    class P(Params):
        weight: float = Field(0.5, ge=0.0, le=1.0)

    def __init__(self, p: P, reranker: Reranker | None = None) -> None:
        self.reranker = reranker or OverlapReranker(p.weight)

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        state.chunks = self.reranker.rerank(state.search_query or state.question, state.chunks)
        return
        yield


class RelevanceNode:
    """Drops chunks that are not relevant enough to answer from.

    Relevance is the dense cosine similarity when the retrieval service reports a
    ``dense`` score, else the share of the query's content words in the chunk.
    Nothing left means the chat answers "I don't know" rather than inventing.
    """

    sockets: ClassVar[Sockets] = Sockets.of(needs=("chunks",), reads=("search_query",), writes=("chunks",))

    class P(Params):
        min_relevance: float | None = Field(None, ge=0.0, le=1.0)

    def __init__(self, p: P) -> None:
        self.p = p

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        threshold = ctx.settings.min_relevance if self.p.min_relevance is None else self.p.min_relevance
        terms = content_terms(state.search_query or state.question)
        kept = []
        for chunk in state.chunks:
            lexical = overlap(terms, chunk.text + " " + chunk.title)
            dense = chunk.scores.get("dense")
            chunk.relevance = max(lexical, float(dense) if dense is not None else 0.0)
            if chunk.relevance >= threshold:
                kept.append(chunk)
        state.chunks = kept
        return
        yield


class HighlightNode:
    sockets: ClassVar[Sockets] = Sockets.of(needs=("chunks",), reads=("search_query",), writes=("results",))

    class P(Params):
        tag: str = Field("mark", pattern=r"^[a-z]{1,10}$")

    def __init__(self, p: P) -> None:
        self.p = p

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        query = state.search_query or state.question
        results = []
        for chunk in state.chunks:
            item = chunk.to_result()
            item.update(highlight(query, chunk, self.p.tag))
            results.append(item)
        state.results = results
        return
        yield


class PromptNode:
    sockets: ClassVar[Sockets] = Sockets.of(
        reads=("chunks",), writes=("plan", "chunks", "no_context", "tracker")
    )

    class P(Params):
        instructions: str | None = None
        max_history_messages: int = Field(6, ge=0, le=100)
        # A worked example of a cited answer before the question (see prompting.EXAMPLE_ANSWER).
        example: bool = False

    def __init__(self, p: P) -> None:
        self.p = p

    def builder(self, ctx: RunContext) -> PromptBuilder:
        kwargs: dict[str, Any] = {
            "max_history_messages": self.p.max_history_messages,
            "example": self.p.example,
        }
        if self.p.instructions:
            kwargs["instructions"] = self.p.instructions
        return BudgetPromptBuilder(
            ctx.counter, ctx.settings.context_tokens, ctx.settings.max_answer_tokens, **kwargs
        )

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        if not state.chunks and state.form is None:
            state.no_context = True
            return
        # With the caller's tools or response_format the model answers even when nothing relevant
        # was found (the prompt is then the question alone): a canned "I don't know" is neither the
        # JSON asked for nor a tool call, and a tool may be how the caller gets the answer.
        tail = state.form.tail if state.form is not None else []
        try:
            state.plan = self.builder(ctx).build(state.question, state.history, state.chunks, tail)
        except PromptTooLong as exc:
            raise InvalidRequest(str(exc), param="messages" if tail else "message") from exc
        state.chunks = state.plan.sources
        state.no_context = not state.plan.sources
        state.tracker = CitationTracker(state.plan.sources)
        return
        yield


def reader_question(state: RunState) -> str:
    """The question as the answer step and the guard read it: a follow-up ("and its capital?")
    with what the rewriter made of it too."""
    if state.search_query and state.search_query != state.question:
        return f"{state.question} {state.search_query}"
    return state.question


def embedded_question(state: RunState) -> str:
    """``reader_question`` as the reader's embedder reads it."""
    return embedded_text(reader_question(state))


def collection_embedder(state: RunState, ctx: RunContext) -> Callable[[list[str]], Any] | None:
    """Texts to vectors with the collection's own embedder (retrieval's ``/embed``: the model is
    in that process, so one call, no model lookup)."""
    collection = state.collection
    if collection is None:
        return None

    async def embed(texts: list[str]) -> list[list[float]]:
        return await ctx.retrieval.embed(collection, texts)

    return embed


def collection_similarity(state: RunState, ctx: RunContext) -> Similarity | None:
    """The reader's similarities: those retrieval computed for the hits' sentences (a retriever
    with ``sentences``), and the collection's embedder for what they lack (one call, none when
    nothing is missing)."""
    embed = collection_embedder(state, ctx)
    if embed is None:
        return None
    asked = embedded_question(state)
    known: dict[str, float] = {}
    for chunk in state.chunks:
        if chunk.cosines_of == asked:
            known.update(chunk.query_cosines)
    fallback = by_embedding(embed)
    return with_known(asked, known, fallback) if known else fallback


async def show_answer(state: RunState, text: str, kind: AnswerKind, citations: list[Citation]) -> EventStream:
    """An answer the pipeline composed itself (the source sentences, or that the documents do
    not say): kept as the answer and streamed like any, word by word and then its citations, so
    a client needs no special path for it."""
    state.answer = text
    state.answer_kind = kind
    for piece in re.findall(r"\S+\s*", text):
        yield TokenEvent(text=piece)
    state.citations = citations
    for citation in citations:
        yield CitationEvent.from_citation(citation)


def reader_scorers(
    ctx: RunContext, reader: str | None, threshold: float | None, state: RunState | None = None
) -> list[AnswerScorer]:
    """The readers a step tries in turn: the one it names, else the tenant's promoted reader
    (with the threshold of its own held-out rows), else the agent's ``reader`` setting; then the
    learned scorer shipped with the agent (``features``: services/agent/reader/features.py, over
    the collection's embedder) for when a served reader is not there (not yet trained,
    unpublished) or fails. Empty: the rules alone. A served reader without a threshold orders the
    candidates and the rules say whether any answers."""
    model, cut = ctx.settings.reader, ctx.settings.reader_threshold
    if reader is not None:
        model = reader
    elif ctx.reader:
        model = ctx.reader
        cut = cut if ctx.reader_threshold is None else ctx.reader_threshold
    if not model:
        return []
    similarity = collection_similarity(state, ctx) if state is not None else None
    # the features scorer needs the collection's embedder (none without a collection)
    features: list[AnswerScorer] = (
        [] if similarity is None else [FeatureScorer(shipped_model(), similarity, threshold=threshold)]
    )
    if model == FEATURES_READER:
        return features
    cut = cut if threshold is None else threshold
    verdict = RuleScorer(similarity) if cut is None else None
    unserved = ctx.unserved
    if unserved is not None and unserved.holds(ctx.api_key, model):
        return features  # a 404 for it lately: not asked again until the hold ends
    missing = None if unserved is None else functools.partial(unserved.mark, ctx.api_key, model)
    return [ReaderScorer(model, cut, ctx.inference.rerank, verdict=verdict, on_missing=missing), *features]


class ReaderRankNode:
    """The reader orders the retrieved chunks by their best sentence's score, so the prompt a
    generating model reads opens with the sources most likely to answer, and what its budget
    drops is the least likely. When no reader scores (none served, none named), the order stays
    as retrieval gave it."""

    sockets: ClassVar[Sockets] = Sockets.of(needs=("chunks",), writes=("chunks",))

    class P(Params):
        reader: str | None = Field(None, max_length=200)
        timeout_s: float = Field(10.0, gt=0.0, le=300.0)

    def __init__(self, p: P) -> None:
        self.p = p

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        candidates = answer_candidates(state.chunks)
        scored = None
        # the order alone is read here: no threshold, and no verdict asked for
        for scorer in reader_scorers(ctx, self.p.reader, float("-inf"), state) if candidates else []:
            try:
                async with asyncio.timeout(self.p.timeout_s):
                    scored = await scorer.score(state.question, state.chunks, candidates)
                break
            except (TimeoutError, TandemError, ValueError) as exc:
                log.warning("reader ranking: %s gave no scores (%s)", scorer.name, exc)
        if scored is None:  # retrieval's order stays
            return
        best = [float("-inf")] * len(state.chunks)
        for c, score in zip(candidates, scored.scores, strict=True):
            best[c.source - 1] = max(best[c.source - 1], score)
        order = sorted(range(len(state.chunks)), key=lambda i: (-best[i], i))
        state.chunks = [state.chunks[i] for i in order]
        return
        yield


class AnswerSelectNode:
    """Before the model is called: the source sentences that answer the question (the reader,
    services/agent/reader/), kept in ``state.selection`` for the guard's extractive answer; and
    when none does, the answer that the documents do not say (``answer_kind: "not_found"``), the
    closest sources cited as ``kind: "see_also"``, without a model call.

    The turn record of a "not found" keeps the prompt the model would have answered from, so a
    correction of it trains the model like any other."""

    sockets: ClassVar[Sockets] = Sockets.of(
        needs=("plan",),
        reads=("search_query", "no_context"),
        writes=("selection", "prompt", "model", "answer", "answer_kind", "citations", "groundedness"),
    )

    class P(Params):
        enabled: bool = True
        # The reader model (None: the tenant's promoted reader, else the agent's ``reader``
        # setting; "": the fallback rules).
        reader: str | None = Field(None, max_length=200)
        # Its threshold (None: the promoted reader's own, else the agent's ``reader_threshold``).
        reader_threshold: float | None = None
        # The fallback's embedder. None: the agent's ``grounding_embedder`` setting; off (or
        # failing): words alone.
        embedder: bool | None = None
        embed_timeout_s: float = Field(10.0, gt=0.0, le=300.0)
        # Off: "not found" is never said; the selection still serves the guard.
        abstain: bool = True
        # On: a question the selection answers gets the selected sentences (answer_kind
        # "extractive") without a model call, unless the caller chose the model (``llm``); off:
        # the model writes the answer and the guard falls back to the selection when it is
        # degenerate.
        extract: bool = False

    def __init__(self, p: P) -> None:
        self.p = p

    def _rules(self, state: RunState, ctx: RunContext) -> RuleScorer:
        use = ctx.settings.grounding_embedder if self.p.embedder is None else self.p.embedder
        return RuleScorer(collection_similarity(state, ctx) if use else None)

    async def _select(self, state: RunState, ctx: RunContext, chunks: list[Chunk]) -> Selection:
        asked = reader_question(state)
        scorers = [
            *reader_scorers(ctx, self.p.reader, self.p.reader_threshold, state),
            self._rules(state, ctx),
        ]
        for scorer in scorers:
            try:
                async with asyncio.timeout(self.p.embed_timeout_s):
                    return await read(asked, chunks, scorer, ctx.settings.answer_passage)
            except TimeoutError:
                log.warning("answer step: %s gave no scores in %s s", scorer.name, self.p.embed_timeout_s)
            except (TandemError, ValueError, KeyError, TypeError) as exc:
                log.warning("answer step: %s failed: %s", scorer.name, exc)
        return await read(asked, chunks, RuleScorer(None), ctx.settings.answer_passage)

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        if not self.p.enabled or state.form is not None or state.plan is None or state.no_context:
            return
        chunks = state.plan.sources
        state.selection = await self._select(state, ctx, chunks)
        if state.selection.found and self.p.extract and not ctx.chosen:
            text, numbers = answer_text(state.question, state.selection)
            cites = [Citation.of(n, chunks[n - 1], kind="extractive", claim=text) for n in numbers]
            state.groundedness = 1.0
            kind: AnswerKind = "extractive"
        elif state.selection.found or not self.p.abstain:
            return
        else:
            selection = state.selection
            text = not_found_text(state.question, chunks, selection.see_also)
            cites = [Citation.of(n, chunks[n - 1], kind="see_also") for n in selection.see_also]
            kind = "not_found"
        # The prompt the model would have answered from, and its model (nothing was generated):
        # a rating or a correction of this answer trains the model like any other.
        state.prompt = list(state.plan.messages)
        state.model = ctx.model
        async for event in show_answer(state, text, kind, cites):
            yield event


class GenerateNode:
    sockets: ClassVar[Sockets] = Sockets.of(
        needs=("plan",),
        reads=("no_context", "answer_kind"),
        # the tracker: it is fed the answer as it streams, and yields its citations
        writes=(
            "prompt",
            "model",
            "sampling",
            "answer",
            "answer_kind",
            "completion",
            "tool_calls",
            "usage",
            "finish_reason",
            "tracker",
        ),
    )

    class P(Params):
        max_tokens: int | None = Field(None, ge=1, le=8192)
        temperature: float | None = Field(None, ge=0.0, le=2.0)
        top_p: float | None = Field(None, gt=0.0, le=1.0)
        # Further sampling parameters of the inference API (e.g. a penalty it gains later), sent
        # with every request of this generator without a code change here.
        sampling: dict[str, float | int | bool | str] = Field(default_factory=dict)

    def __init__(self, p: P, generator: Generator | None = None) -> None:
        self.p = p
        self.generator = generator

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        if state.answer_kind != "generated":
            return  # the answer step answered: the documents do not say, or its sentences
        if state.plan is None or (state.no_context and state.form is None):
            state.answer = NO_CONTEXT_ANSWER.format(collection=state.collection)
            state.answer_kind = "not_found"
            yield TokenEvent(text=state.answer)
            return
        # A regenerated draft samples at its own temperature (state.options), so it can differ.
        temperature = state.options.get("temperature", self.p.temperature)
        max_tokens = self.p.max_tokens
        asked = state.options.get("max_tokens")
        if isinstance(asked, int):
            # the prompt's budget reserved the pipeline's answer tokens: a caller may ask fewer
            max_tokens = min(asked, self.p.max_tokens or ctx.settings.max_answer_tokens)
        form = state.form.body() if state.form is not None else {}
        gen = self.generator or InferenceGenerator(
            max_tokens, temperature, self.p.top_p, {**self.p.sampling, **form}
        )
        # The exact messages and sampling the model gets: the turn record keeps them for training.
        state.prompt = list(state.plan.messages)
        state.model = ctx.model
        state.sampling = gen.sampling(ctx) if isinstance(gen, InferenceGenerator) else Sampling()
        # A JSON answer (response_format, a forced call) is constrained by the inference's grammar:
        # cutting it at a repeat, or reading "[1]" in a JSON array as a citation marker, would break it.
        text_answer = state.form is None or not state.form.json_answer
        guard = RepetitionGuard()
        stream = gen.generate(ctx, state.plan.messages)
        looped = False
        try:
            async for piece in stream:
                if isinstance(piece, ToolCallDelta):
                    # a tool call is the caller's to run: passed on as it streams, never rewritten
                    state.add_tool_delta(piece)
                    fn = piece.function
                    yield ToolCallDeltaEvent(
                        index=piece.index,
                        id=piece.id,
                        name=fn.name if fn is not None else None,
                        arguments=fn.arguments if fn is not None else None,
                    )
                    continue
                state.answer += piece
                yield TokenEvent(text=piece)
                if not text_answer:
                    continue
                if state.tracker is not None:
                    for citation in state.tracker.feed(piece):
                        yield CitationEvent.from_citation(citation)
                if guard.feed(piece):
                    looped = True
                    break
        finally:
            # Closing the stream closes the upstream request, which frees the inference slot.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        if isinstance(gen, InferenceGenerator):
            state.usage = gen.usage
            state.finish_reason = gen.finish_reason
        if looped:
            state.answer = guard.trim(state.answer)
            state.finish_reason = "repetition"
        # What the model wrote; a later guard may show something else, the record keeps this.
        state.completion = state.answer


class CiteNode:
    sockets: ClassVar[Sockets] = Sockets.of(
        needs=("tracker", "answer"),
        reads=("answer_kind", "tool_calls"),
        writes=("tracker", "citations", "invalid_citations"),
    )

    class P(Params):
        attribute_uncited: bool = True
        min_overlap: float = Field(0.5, ge=0.0, le=1.0)

    def __init__(self, p: P) -> None:
        self.p = p

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        if state.tracker is None or state.answer_kind != "generated":
            return
        if state.structured:
            # JSON or tool calls carry no markers to resolve (a JSON array "[1]" is not one): the
            # citations are the sources the model was shown (kind "source").
            state.citations = [
                Citation.of(n, c, kind="source") for n, c in enumerate(state.tracker.chunks, 1)
            ]
            for citation in state.citations:
                yield CitationEvent.from_citation(citation)
            return
        if not state.tracker.text and state.answer:
            state.tracker.feed(state.answer)
        for citation in state.tracker.finish():
            yield CitationEvent.from_citation(citation)
        state.citations = state.tracker.citations
        state.invalid_citations = list(state.tracker.invalid)
        if not state.citations and self.p.attribute_uncited:
            state.citations = attribute(state.answer, state.tracker.chunks, self.p.min_overlap)
            for citation in state.citations:
                yield CitationEvent.from_citation(citation)


class GuardNode:
    """The groundedness guard (see services/agent/grounding.py), after the citations are resolved.

    A degenerate answer is replaced: a ``reset`` event tells the client to clear what streamed,
    then the extractive answer streams as tokens with citations of ``kind: "extractive"``. A
    partly supported answer stays; its unsupported sentences are listed in ``state.unsupported``.
    The model's own text stays in ``state.completion`` (the turn record's ``completion``).
    """

    sockets: ClassVar[Sockets] = Sockets.of(
        needs=("tracker", "answer"),
        reads=("no_context", "answer_kind", "tool_calls", "search_query", "finish_reason", "selection"),
        writes=(
            "grounding",
            "groundedness",
            "unsupported",
            "invalid_citations",
            "answer",
            "answer_kind",
            "citations",
        ),
    )

    class P(Params):
        enabled: bool | None = None  # None: the agent's ``grounding_guard`` setting
        min_support: float = Field(0.5, ge=0.0, le=1.0)
        # Sentences the overlap misses are judged again with the collection's embedder (through
        # retrieval's /embed). None: the agent's ``grounding_embedder`` setting.
        embedder: bool | None = None
        min_similarity: float = Field(MIN_SIMILARITY, ge=-1.0, le=1.0)
        # Embedding a few sentences takes well under a second; a stuck service must not hold the
        # answer for the client's whole timeout.
        embed_timeout_s: float = Field(10.0, gt=0.0, le=300.0)
        max_sentences: int = Field(2, ge=1, le=10)

    def __init__(self, p: P) -> None:
        self.p = p

    async def _with_embeddings(
        self, report: GroundingReport, state: RunState, ctx: RunContext, sources: list[str]
    ) -> GroundingReport:
        """The embedding side of the check; on any failure (a service down, a model inference does
        not serve) the lexical verdict stands: the answer must never fail for it."""
        embed = collection_embedder(state, ctx)
        if embed is None:
            return report
        try:
            async with asyncio.timeout(self.p.embed_timeout_s):
                return await with_embeddings(report, state.answer, sources, embed, self.p.min_similarity)
        except TimeoutError:
            log.warning(
                "groundedness guard: lexical overlap only, embedding failed: no answer in %s s",
                self.p.embed_timeout_s,
            )
        except (TandemError, ValueError, KeyError, TypeError) as exc:
            log.warning("groundedness guard: lexical overlap only, embedding failed: %s", exc)
        return report

    async def _extractive(
        self, state: RunState, asked: str, chunks: list[Chunk], passage: int
    ) -> tuple[str, list[int]]:
        """The answer step's selection; where it found none (or the pipeline has no answer step),
        the best-scored sentence with the neighbours it needs: the guard replaces an answer that
        says nothing, so even a weak sentence of the sources is better."""
        selection = state.selection
        if selection is None:
            selection = await read(asked, chunks, RuleScorer(None), passage)
        if not selection.found:
            if selection.best is None:
                return "", []
            picked = with_neighbours(selection.best, chunks, passage)
            selection = Selection(True, picked=picked, best=selection.best)
        selection.picked = selection.picked[: max(self.p.max_sentences, 1) + 2 * (passage + 1)]
        return answer_text(state.question, selection)

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        enabled = ctx.settings.grounding_guard if self.p.enabled is None else self.p.enabled
        if not enabled or state.tracker is None or state.no_context or not state.tracker.chunks:
            return
        if state.answer_kind != "generated":
            return
        if state.structured:
            # A JSON answer or tool calls are the form the caller asked for: an extractive answer
            # would replace them with text, and sentence support means nothing for them.
            return
        chunks = state.tracker.chunks
        asked = reader_question(state)
        report = check(
            state.answer,
            asked,
            [c.text for c in chunks],
            self.p.min_support,
            repeated=state.finish_reason == "repetition",
        )
        embedder = ctx.settings.grounding_embedder if self.p.embedder is None else self.p.embedder
        if embedder:
            report = await self._with_embeddings(report, state, ctx, [c.text for c in chunks])
        state.grounding = report.verdict
        state.groundedness = report.share
        if not report.degenerate:
            state.unsupported = [{"text": s.text, "start": s.start, "end": s.end} for s in report.unsupported]
            return
        text, numbers = await self._extractive(state, asked, chunks, ctx.settings.answer_passage)
        if not text:
            return
        yield ResetEvent(reason=report.verdict)
        state.groundedness = 1.0
        state.invalid_citations = []
        cites = [Citation.of(n, chunks[n - 1], kind="extractive", claim=text) for n in numbers]
        async for event in show_answer(state, text, "extractive", cites):
            yield event


class RunnableNode:
    """A LangChain ``Runnable`` as a pipeline component.

    It is invoked with ``state.view()`` (a dict), or just the question or search query
    (``input``; so a LangChain retriever fits as is), and its output replaces one field:
    ``search_query`` or ``answer`` (a string or a message with ``content``), or
    ``chunks`` (LangChain ``Document``s or result dicts).
    """

    class P(Params):
        target: str = Field(..., description="'package.module:attribute' naming a Runnable")
        field: Literal["search_query", "answer", "chunks"]
        input: Literal["state", "question", "search_query"] = "state"

    def __init__(self, p: P, runnable: Any = None) -> None:
        self.p = p
        # the view it is fed holds the search query, the chunks and the answer; it writes one slot
        self.sockets = Sockets.of(reads=("search_query", "chunks", "answer"), writes=(p.field,))
        self.runnable = runnable if runnable is not None else _import_target(p.target)
        if not hasattr(self.runnable, "ainvoke"):
            raise InvalidRequest(f"{p.target!r} is not a LangChain Runnable", param="target")

    async def run(self, state: RunState, ctx: RunContext) -> EventStream:
        view = state.view()
        out = await self.runnable.ainvoke(view if self.p.input == "state" else view[self.p.input])
        if self.p.field == "chunks":
            state.chunks = [_to_chunk(item) for item in out]
        else:
            text = getattr(out, "content", out)
            setattr(state, self.p.field, str(text))
            if self.p.field == "answer":
                yield TokenEvent(text=state.answer)


def _import_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise InvalidRequest(f"target {target!r} must look like 'package.module:attribute'", param="target")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise InvalidRequest(f"cannot import {target!r}: {exc}", param="target") from exc
    return obj() if isinstance(obj, type) else obj


def _to_chunk(item: Any) -> Chunk:
    if isinstance(item, dict):
        return Chunk.from_result(item)
    meta = dict(getattr(item, "metadata", {}) or {})
    return Chunk.from_result({**meta, "text": getattr(item, "page_content", str(item)), "metadata": meta})


NodeFactory = Callable[[Any], Component]

NODE_TYPES: dict[str, tuple[type[Params], Callable[[Any], Any]]] = {
    "history_rewriter": (RewriteNode.P, RewriteNode),
    "retriever": (RetrieveNode.P, RetrieveNode),
    "overlap_reranker": (RerankNode.P, RerankNode),
    "relevance_filter": (RelevanceNode.P, RelevanceNode),
    "highlighter": (HighlightNode.P, HighlightNode),
    "prompt_builder": (PromptNode.P, PromptNode),
    "answer_selector": (AnswerSelectNode.P, AnswerSelectNode),
    "reader_ranker": (ReaderRankNode.P, ReaderRankNode),
    "generator": (GenerateNode.P, GenerateNode),
    "citation_resolver": (CiteNode.P, CiteNode),
    "groundedness_guard": (GuardNode.P, GuardNode),
    "langchain_runnable": (RunnableNode.P, RunnableNode),
}


def register_node_type(name: str, params: type[Params], factory: Callable[[Any], Any]) -> None:
    """Adds a node type (for code that embeds the agent service and brings its own components)."""
    NODE_TYPES[name] = (params, factory)
