"""Documents: JSON ingestion, file uploads, get / delete / list."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, File, Form, Query, Request, Response, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from services.common.errors import InvalidRequest, NotFound, PayloadTooLarge
from services.common.paths import safe_filename
from services.retrieval.api.deps import collection, manager, tenant
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.parsing import ParsedDocument, check_supported, parse_file
from services.retrieval.ingest import enqueue_job
from services.retrieval.protocol import AddDocuments, Document, DocumentPage, IngestResponse

router = APIRouter(prefix="/v1/collections", tags=["documents"])


def _limit_bytes(request: Request) -> int:
    mb = request.app.state.settings.max_upload_mb or request.app.state.common.max_upload_mb
    return int(mb) * 1024 * 1024


def _ingest_now(request: Request, name: str, docs: list[InputDocument]) -> JSONResponse:
    col = collection(request, name)
    res = col.ingest(docs)
    body = IngestResponse(
        documents=res.documents,
        document_ids=list(dict.fromkeys(d.id for d in docs)),
        chunks_added=res.chunks_added,
        chunks_removed=res.chunks_removed,
        chunks_unchanged=res.chunks_unchanged,
    )
    return JSONResponse(body.model_dump(), status_code=201)


def _as_job(request: Request, name: str, docs: list[InputDocument], filename: str = "") -> JSONResponse:
    col = collection(request, name)
    job_id = enqueue_job(
        request.app.state.celery, request.app.state.jobs, col.root, tenant(request), name, docs, filename
    )
    body = IngestResponse(
        documents=len(docs),
        document_ids=list(dict.fromkeys(d.id for d in docs)),
        job_id=job_id,
        status_url=f"/v1/jobs/{job_id}",
        events_url=f"/v1/jobs/{job_id}/events",
    )
    return JSONResponse(body.model_dump(), status_code=202)


@router.post(
    "/{name}/documents",
    status_code=201,
    response_model=IngestResponse,
    responses={202: {"model": IngestResponse, "description": "queued as an ingestion job"}},
)
def add_documents(name: str, body: AddDocuments, request: Request) -> JSONResponse:
    """Ingest JSON documents; a document with an id already stored replaces it."""
    collection(request, name)  # 404 before any work
    docs = [InputDocument(d.id, d.text, d.title or "", d.metadata or {}) for d in body.documents]
    for i, d in enumerate(docs):
        if not d.text.strip():
            raise InvalidRequest(
                f"documents[{i}].text is blank (document {d.id!r})", param=f"documents.{i}.text"
            )
    if len(docs) > request.app.state.settings.async_documents:
        return _as_job(request, name, docs)
    return _ingest_now(request, name, docs)


async def _read_limited(upload: UploadFile, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        part = await upload.read(1 << 20)
        if not part:
            break
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(
                f"file {upload.filename!r} is larger than the upload limit of {limit // (1024 * 1024)} MiB "
                "(TANDEM_RETRIEVAL_MAX_UPLOAD_MB / TANDEM_MAX_UPLOAD_MB)",
                param="file",
                code="file_too_large",
            )
        chunks.append(part)
    return b"".join(chunks)


@router.post(
    "/{name}/files",
    status_code=201,
    response_model=IngestResponse,
    responses={202: {"model": IngestResponse, "description": "queued as an ingestion job"}},
)
async def upload_files(
    name: str,
    request: Request,
    file: list[UploadFile] = File(..., description=".txt .md .html .pdf .docx or .jsonl; several allowed"),
    metadata: str | None = Form(None, description="JSON object added to every document's metadata"),
) -> JSONResponse:
    limit = _limit_bytes(request)
    declared = int(request.headers.get("content-length") or 0)
    if declared > limit * max(len(file), 1) + (1 << 20):
        raise PayloadTooLarge(
            f"upload of {declared} bytes is larger than the upload limit of {limit // (1024 * 1024)} MiB",
            param="file",
            code="file_too_large",
        )
    extra: dict[str, Any] = {}
    if metadata:
        try:
            extra = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"metadata: not JSON ({exc.msg})", param="metadata") from None
        if not isinstance(extra, dict):
            raise InvalidRequest("metadata: must be a JSON object", param="metadata")
    await run_in_threadpool(collection, request, name)  # 404 before reading the files
    parsed: list[ParsedDocument] = []
    total = 0
    for up in file:
        fname = safe_filename(up.filename or "", param="file")
        check_supported(fname)
        data = await _read_limited(up, limit)
        total += len(data)
        parsed.extend(await run_in_threadpool(parse_file, fname, data))
    docs = [InputDocument(p.id, p.text, p.title, {**p.metadata, **extra}) for p in parsed]
    settings = request.app.state.settings
    if total > settings.async_upload_kb * 1024 or len(docs) > settings.async_documents:
        return await run_in_threadpool(_as_job, request, name, docs, ",".join(f.filename or "" for f in file))
    return await run_in_threadpool(_ingest_now, request, name, docs)


@router.get("/{name}/documents", response_model=DocumentPage)
def list_documents(
    name: str,
    request: Request,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> DocumentPage:
    col = collection(request, name)
    docs, total = col.store.list_documents(limit, offset)
    nxt = offset + len(docs)
    return DocumentPage(
        documents=[Document(**d) for d in docs],
        total=total,
        limit=limit,
        offset=offset,
        next_offset=nxt if nxt < total else None,
    )


@router.get("/{name}/documents/{doc_id:path}", response_model=Document)
def get_document(name: str, doc_id: str, request: Request) -> Document:
    doc = collection(request, name).store.get_document(doc_id)
    if doc is None:
        raise NotFound(f"document {doc_id!r} not found in collection {name!r}", param="id")
    return Document(**doc)


@router.delete("/{name}/documents/{doc_id:path}", status_code=204)
def delete_document(name: str, doc_id: str, request: Request) -> Response:
    if not collection(request, name).delete_document(doc_id):
        raise NotFound(f"document {doc_id!r} not found in collection {name!r}", param="id")
    return Response(status_code=204)


__all__ = ["manager", "router"]
