"""HTTP clients of the retrieval, inference and trainer services.

The agent calls them with the *user's own* key, so tenant isolation is theirs to
enforce and follows automatically; ``service_client`` passes the request id on.
Upstream errors become typed errors here: a 404 from retrieval is an unknown
collection for the caller (404), a 4xx is the caller's bad input (400), anything
else is an upstream failure (502/503): services.common.upstream maps them.

What another service answers is its JSON object (``JsonObject``): its models are its own (services
never import each other's code), so the agent reads the members it needs and passes the rest on
as given. What the agent sends has its shape here (``SearchBody``, ``ReindexPatch``, ``JobBody``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, NotRequired, TypedDict

import httpx
from pydantic import BaseModel

from services.agent.chunks import Chunk
from services.agent.protocol import Sampling
from services.common.collection_embed import EMBED_TEXTS, EmbedResponse
from services.common.errors import Conflict, InvalidRequest, NotFound
from services.common.http import service_client
from services.common.jsonsafe import JsonObject
from services.common.openai_client import OpenAIClient
from services.common.openai_wire import (
    ChatCompletion,
    ChatCompletionChunk,
    EmbeddingList,
    ModelCard,
    ModelList,
    RerankList,
)
from services.common.replicas import ReplicaPool
from services.common.telemetry import set_attributes, span
from services.common.upstream import (
    UpstreamFailed,
    UpstreamReply,
    UpstreamStatus,
    tandem_error,
    unreachable,
    upstream_error,
)


class SearchBody(TypedDict):
    """``POST /v1/collections/{name}/search`` as the agent sends it."""

    query: str
    top_k: int
    mode: str
    rerank: NotRequired[bool]
    section_tokens: NotRequired[int]
    filters: NotRequired[JsonObject]
    sentences: NotRequired[bool]
    sentence_query: NotRequired[str]


class GateQueryBody(TypedDict):
    query: str
    relevant: list[str]  # the ids of the collection's documents that answer it


class ReindexGate(TypedDict):
    """Retrieval's ``only_if_better``: the queries that judge the new index version."""

    queries: list[GateQueryBody]
    mode: NotRequired[str]
    min_gain: NotRequired[float]


class ReindexPatch(TypedDict):
    """``PATCH /v1/collections/{name}`` as a gated reindex sends it."""

    embedder: str
    only_if_better: NotRequired[ReindexGate]


class JobBody(TypedDict, total=False):
    """``POST /v1/jobs`` on the trainer, the fields the agent sets (the trainer checks them)."""

    type: str
    base_model: str
    dataset: str
    lora: JsonObject
    publish: bool
    eval_fraction: float
    hyperparameters: JsonObject
    reader_kind: str


class _ServiceClient:
    service = ""

    def __init__(self, base_url: str, api_key: str, timeout: float = 60.0) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = timeout

    def _client(self) -> httpx.AsyncClient:
        return service_client(self.base_url, self.api_key, self.timeout)

    async def _post(self, path: str, param: str | None = None, **kwargs: Any) -> JsonObject:
        """The JSON object answered; an error status is the upstream's error, mapped (its own
        ``param`` when ``param`` is None)."""
        try:
            async with self._client() as client:
                resp = await client.post(path, **kwargs)
        except httpx.HTTPError as exc:
            raise unreachable(self.service, exc) from exc
        if resp.status_code >= 400:
            reply = UpstreamReply.of(self.service, resp)
            raise upstream_error(reply, param=param or reply.param)
        return dict(resp.json())

    async def _get(self, path: str, param: str) -> JsonObject:
        """The JSON object answered; an error status is the upstream's error, mapped, naming ``param``."""
        try:
            async with self._client() as client:
                resp = await client.get(path)
        except httpx.HTTPError as exc:
            raise unreachable(self.service, exc) from exc
        if resp.status_code >= 400:
            raise upstream_error(UpstreamReply.of(self.service, resp), param=param)
        return dict(resp.json())


class RetrievalClient(_ServiceClient):
    service = "retrieval"

    async def search(
        self,
        collection: str,
        query: str,
        *,
        top_k: int = 10,
        mode: str = "hybrid",
        rerank: bool = False,
        filters: JsonObject | None = None,
        section_tokens: int | None = None,
        sentence_query: str | None = None,
    ) -> list[Chunk]:
        """The hits; with ``section_tokens``, each hit's text is its enclosing section (up to that
        many tokens around the chunk) and its offsets are the section's; with ``sentence_query``
        (the question as the reader embeds it), each hit's candidate answer sentences come scored
        against it (``Chunk.query_cosines``)."""
        body: SearchBody = {"query": query, "top_k": top_k, "mode": mode}
        if rerank:
            body["rerank"] = True
        if section_tokens:
            body["section_tokens"] = section_tokens
        if filters:
            body["filters"] = filters
        if sentence_query is not None:
            body["sentences"] = True
            body["sentence_query"] = sentence_query
        with span(
            "retrieval.search", collection=collection, mode=mode, top_k=top_k, rerank=rerank
        ) as current:
            start = time.perf_counter()
            try:
                found = await self._post(f"/v1/collections/{collection}/search", "collection", json=body)
            except NotFound:
                raise NotFound(f"unknown collection {collection!r}", param="collection") from None
            hits = [Chunk.from_result(item) for item in found.get("results", [])]
            for hit in hits:
                hit.cosines_of = sentence_query or ""
            set_attributes(current, hits=len(hits), ms=round((time.perf_counter() - start) * 1000, 1))
        return hits

    async def check_readable(self, collection: str) -> None:
        """Nothing when the caller may read ``collection``; else the upstream's error, mapped (a
        404 for a collection that does not exist or that this key may not read)."""
        await self._get(f"/v1/collections/{collection}", "collection")

    async def embed(self, collection: str, texts: list[str]) -> list[list[float]]:
        """``texts`` as ``collection``'s own embedder reads them (retrieval holds it in process):
        one L2-normalised vector per text, in order; sent in parts of retrieval's per-request cap."""
        vectors: list[list[float]] = []
        for start in range(0, len(texts), EMBED_TEXTS):
            part = texts[start : start + EMBED_TEXTS]
            got = await self._post(f"/v1/collections/{collection}/embed", "collection", json={"input": part})
            vectors += EmbedResponse.model_validate(got).vectors
        return vectors

    async def embedding_model(self, collection: str) -> str:
        """The embedding model ``collection`` was built with (as the inference service names it)."""
        return str((await self._get(f"/v1/collections/{collection}", "collection"))["embedding_model"])

    async def document_titles(self, collection: str, document_ids: list[str]) -> dict[str, str]:
        """Titles of documents (best effort: search hits may not carry them)."""
        out: dict[str, str] = {}
        try:
            async with self._client() as client:
                for doc_id in dict.fromkeys(document_ids):
                    resp = await client.get(f"/v1/collections/{collection}/documents/{doc_id}")
                    if resp.status_code == 200:
                        body = resp.json()
                        meta = body.get("metadata") or {}
                        title = body.get("title") or (meta.get("title") if isinstance(meta, dict) else "")
                        if title:
                            out[doc_id] = str(title)
        except httpx.HTTPError:
            pass
        return out

    async def documents(self, collection: str) -> list[JsonObject]:
        """Every document of ``collection`` (retrieval's objects: id, title, metadata), a page at a time."""
        out: list[JsonObject] = []
        offset: int | None = 0
        while offset is not None:
            page = await self._get(
                f"/v1/collections/{collection}/documents?limit=1000&offset={offset}", "collection"
            )
            out += [dict(d) for d in page.get("documents", [])]
            offset = page.get("next_offset")
        return out

    async def reindex(self, collection: str, body: ReindexPatch) -> JsonObject:
        """``PATCH /v1/collections/{name}``: the reindex job retrieval queued (its 202)."""
        try:
            async with self._client() as client:
                resp = await client.patch(f"/v1/collections/{collection}", json=body)
        except httpx.HTTPError as exc:
            raise unreachable(self.service, exc) from exc
        if resp.status_code >= 400:
            reply = UpstreamReply.of(self.service, resp)
            if resp.status_code == 409:
                # a reindex already running is a conflict for the caller too, not bad input
                raise Conflict(f"retrieval: {reply.message}", param="collection")
            raise upstream_error(reply, param=reply.param)
        return dict(resp.json())


# OpenAI fields a caller's request passes to the inference service as sent (the facade's tools and
# response_format): an inference 400 naming one of them keeps its ``param``, the caller's own.
CALLER_PARAMS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def _failed(exc: UpstreamFailed | httpx.HTTPError) -> Exception:
    if isinstance(exc, UpstreamStatus) and exc.reply.status_code == 400:
        param = exc.reply.param
        if param is not None and param.split(".")[0].split("[")[0] in CALLER_PARAMS:
            # the caller's own field, refused by the inference's validation: its 400 as it is
            return InvalidRequest(exc.reply.message, param=param)
    return tandem_error("inference", exc)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(Sampling):
    """A chat completion request to the inference service, as the agent sends it: the fields
    given, and only those, are in the JSON (``None`` included when given); its sampling is
    :class:`Sampling`'s. ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    ``response_format`` are the OpenAI facade's caller's own or the agent loop's."""

    model: str
    messages: list[dict[str, Any]]
    stream_options: StreamOptions | None = None

    def body(self) -> JsonObject:
        """The JSON body: the fields given, the model and messages first (as OpenAI writes it)."""
        data = self.model_dump(exclude_unset=True)
        return {"model": data.pop("model"), "messages": data.pop("messages"), **data}

    def sampling(self) -> Sampling:
        """What the request asks beyond its model and messages (a turn record keeps it)."""
        return Sampling.model_validate(self.model_dump(exclude_unset=True, exclude={"model", "messages"}))


class InferenceClient:
    """OpenAI-style chat completions over the inference replicas, as typed objects; a replica
    that dies before answering is replaced by another (see services.common.replicas)."""

    def __init__(self, replicas: ReplicaPool | str, api_key: str, timeout: float = 120.0) -> None:
        self.api = OpenAIClient(replicas, api_key, service="inference", timeout=timeout)

    async def models(self) -> list[ModelCard]:
        try:
            return (await self.api.request_as(ModelList, "GET", "/models")).data
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise tandem_error("inference", exc) from exc

    async def complete(self, request: ChatRequest) -> ChatCompletion:
        try:
            return await self.api.request_as(
                ChatCompletion, "POST", "/chat/completions", {**request.body(), "stream": False}
            )
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise _failed(exc) from exc

    async def embed(self, model: str, texts: list[str]) -> list[list[float]]:
        """``/v1/embeddings``: one vector per text, in order (L2-normalised by the service)."""
        try:
            body = {"model": model, "input": texts}
            return (await self.api.request_as(EmbeddingList, "POST", "/embeddings", body)).vectors()
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise tandem_error("inference", exc) from exc

    async def rerank(self, model: str, query: str, documents: list[str]) -> list[float]:
        """``/v1/rerank``: one relevance score per document, in order (a reader or a reranker)."""
        try:
            body = {"model": model, "query": query, "documents": documents, "return_documents": False}
            got = await self.api.request_as(RerankList, "POST", "/rerank", body)
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise tandem_error("inference", exc) from exc
        return got.scores(len(documents))

    async def stream(self, request: ChatRequest) -> AsyncIterator[ChatCompletionChunk]:
        """The chunks of the answer; leaving early closes the connection, which the inference
        service takes as a disconnect and frees the slot."""
        try:
            async for chunk in self.api.stream("/chat/completions", request.body(), ChatCompletionChunk):
                yield chunk
        except (UpstreamFailed, httpx.HTTPError) as exc:
            raise _failed(exc) from exc


class TrainerClient(_ServiceClient):
    """The trainer's dataset and job API, called with the caller's own key (so files and jobs
    belong to the caller's tenant)."""

    service = "trainer"

    async def upload_file(self, filename: str, data: bytes) -> JsonObject:
        """POST /v1/files (multipart): the trainer checks every row before it stores the file."""
        return await self._post("/v1/files", "format", files={"file": (filename, data, "application/jsonl")})

    async def create_job(self, body: JobBody) -> JsonObject:
        return await self._post("/v1/jobs", json=body)

    async def job(self, job_id: str) -> JsonObject:
        """GET /v1/jobs/{id}; another tenant's or a missing job is a NotFound."""
        return await self._get(f"/v1/jobs/{job_id}", "job_id")
