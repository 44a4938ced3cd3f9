"""What an embedder job reads of its retrieval collection, over the retrieval service's API with
the caller's own key (so the retrieval service decides what the caller may read: another
tenant's collection is its 404): its documents with their chunks, and its hybrid search.

The trainer imports nothing of the retrieval service: the wire models below name the fields it
reads of the retrieval service's answers (``Document``, ``SearchResponse``) and ignore the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict

from services.common.errors import Forbidden, InvalidRequest
from services.common.replicas import replica_pool, request_sync
from services.common.upstream import UpstreamReply, unreachable, upstream_error

if TYPE_CHECKING:
    from services.trainer.state import TrainerState

M = TypeVar("M", bound=BaseModel)


class _Read(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChunkSpan(_Read):
    chunk_id: str
    start: int
    end: int
    context: str = ""  # title and headings, indexed before the chunk's text


class StoredDocument(_Read):
    id: str
    title: str = ""
    text: str | None = None
    chunk_list: list[ChunkSpan] | None = None


class DocumentPage(_Read):
    documents: list[StoredDocument]
    next_offset: int | None = None


class Hit(_Read):
    chunk_id: str
    document_id: str
    text: str
    title: str = ""


class Hits(_Read):
    results: list[Hit]


PAGE = 100  # documents a listing page holds with their text and chunks (the service's most)


def retrieval_call(
    st: TrainerState, key: str, path: str, param: str, reply: type[M], body: dict[str, Any] | None = None
) -> M:
    """GET ``path`` of the retrieval service (POST ``body`` when given: a search changes nothing,
    so a replica that fails is asked again) with the caller's key, read as ``reply``."""
    pool = replica_pool([st.common.url_of("retrieval")], "retrieval")
    try:
        resp = request_sync(
            pool,
            "GET" if body is None else "POST",
            path,
            headers={"Authorization": f"Bearer {key}"},
            json=body,
            timeout=60.0,
        )
    except httpx.HTTPError as exc:
        raise unreachable("retrieval", exc, param) from None
    if resp.status_code >= 400:
        # the mapping every service uses for an upstream's answer: 404 stays 404 (another tenant's
        # collection), a 429 keeps its Retry-After, a 5xx is the upstream's (502)
        raise upstream_error(UpstreamReply.of("retrieval", resp), param)
    return reply.model_validate(resp.json())


def check_writable(st: TrainerState, key: str, name: str) -> None:
    """403 unless the caller may write collection ``name``: a job that switches the collection to
    its embedder (``apply``) changes the collection, which the worker later does as the tenant, so
    the caller's own right to write it is checked here. The retrieval service shows a
    collection's access list to the callers who may write it (its admins and writers) only."""
    pool = replica_pool([st.common.url_of("retrieval")], "retrieval")
    path = f"/v1/collections/{quote(name, safe='')}/access"
    try:
        resp = request_sync(pool, "GET", path, headers={"Authorization": f"Bearer {key}"}, timeout=60.0)
    except httpx.HTTPError as exc:
        raise unreachable("retrieval", exc, "collection") from None
    if resp.status_code == 403:
        raise Forbidden(
            f"apply: this caller may read collection {name!r} but not write it, and switching its "
            f"embedder writes it (retrieval: {UpstreamReply.of('retrieval', resp).message})",
            param="apply",
            code="forbidden",
        )
    if resp.status_code >= 400:
        raise upstream_error(UpstreamReply.of("retrieval", resp), "collection")


def indexed(context: str, text: str) -> str:
    """What the retrieval service embeds and BM25-indexes for a chunk (its ``index_text``)."""
    return f"{context}\n{text}" if context else text


@dataclass(frozen=True)
class CollectionDoc:
    """A document of a job's collection, as the retrieval service holds it."""

    title: str
    text: str
    # (chunk id, the text indexed for it) in document order
    chunks: tuple[tuple[str, str], ...] = ()


def collection_documents(st: TrainerState, key: str, name: str) -> dict[str, CollectionDoc]:
    """Collection ``name``'s documents by id, with their chunks."""
    base = f"/v1/collections/{quote(name, safe='')}/documents"
    docs: dict[str, CollectionDoc] = {}
    offset: int | None = 0
    while offset is not None:
        # a page of whole documents (text and chunks) a request: one request per document would
        # run into the tenant's request rate on a collection of thousands
        page = retrieval_call(
            st, key, f"{base}?limit={PAGE}&offset={offset}&full=true", "collection", DocumentPage
        )
        for doc in page.documents:
            text = doc.text or ""
            chunks = tuple(
                (c.chunk_id, indexed(c.context, text[c.start : c.end])) for c in doc.chunk_list or []
            )
            docs[doc.id] = CollectionDoc(doc.title, text, chunks)
            if len(docs) > st.settings.max_dataset_rows:
                raise InvalidRequest(
                    f"collection {name!r} has more than {st.settings.max_dataset_rows} documents "
                    "(TANDEM_TRAINER_MAX_DATASET_ROWS)",
                    param="collection",
                )
        offset = page.next_offset
    return docs


def search(st: TrainerState, key: str, name: str, query: str, top_k: int) -> list[Hit]:
    """Collection ``name``'s hybrid ranking of ``query`` (its ``top_k`` best chunks), as a
    user's search would rank it."""
    body = {"query": query, "top_k": top_k, "mode": "hybrid"}
    return retrieval_call(
        st, key, f"/v1/collections/{quote(name, safe='')}/search", "collection", Hits, body
    ).results
