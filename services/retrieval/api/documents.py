"""Documents: JSON ingestion, file uploads, get / delete / list."""

from __future__ import annotations

import json
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Query, Request, Response, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse

from services.common import jsonsafe
from services.common.audit import audit_from_thread, audit_request
from services.common.errors import InvalidRequest, NotFound, PayloadTooLarge
from services.common.idempotency import RESPONSES as IDEMPOTENCY_RESPONSES
from services.common.idempotency import file_fingerprint, idempotent
from services.common.paths import safe_filename
from services.common.quota import check_quota, folder_bytes
from services.retrieval.api.deps import (
    CollectionDep,
    CollectionName,
    check_access,
    collection,
    manager,
    tenant,
)
from services.retrieval.core.originals import MEDIA_TYPES, find_original
from services.retrieval.core.parsing import (
    UNTRUSTED,
    InputDocument,
    check_supported,
    extension_of,
    parse_file,
)
from services.retrieval.core.renditions import tiff_page_png
from services.retrieval.ingest import enqueue_files_job, enqueue_job, limits_of
from services.retrieval.protocol import AddDocuments, Document, DocumentPage, IngestResponse

router = APIRouter(
    prefix="/v1/collections",
    tags=["documents"],
    responses={
        403: {"description": "the caller may read the collection but not write it (the message names it)"},
        404: {"description": "no such collection (or one the caller may not read) or document"},
    },
    dependencies=[Depends(check_access)],
)


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
    responses={
        202: {"model": IngestResponse, "description": "queued as an ingestion job"},
        400: {"description": "a document is invalid (the message names the field and value)"},
        401: {"description": "missing or unknown API key"},
        404: {"description": "no such collection"},
        413: {"description": "the request is larger than TANDEM_MAX_BODY_MB"},
        **IDEMPOTENCY_RESPONSES,
    },
)
async def add_documents(name: str, body: AddDocuments, request: Request) -> Any:
    """Ingest JSON documents; a document with an id already stored replaces it. With an
    ``Idempotency-Key`` header a retry returns the first answer (the same job, if it became one)."""

    async def create() -> tuple[int, Any]:
        resp = await run_in_threadpool(_add_documents, name, body, request)
        await audit_request(
            request, "document.upload", name, {"documents": [d.id for d in body.documents][:100]}
        )
        return resp.status_code, json.loads(bytes(resp.body))

    return await idempotent(request, tenant(request), create)


def _add_documents(name: str, body: AddDocuments, request: Request) -> JSONResponse:
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


UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    202: {
        "model": IngestResponse,
        "description": "queued as an ingestion job (PDF, DOCX, HTML, large uploads)",
    },
    400: {"description": "a file or the metadata is invalid (the message names the file and the problem)"},
    401: {"description": "missing or unknown API key"},
    404: {"description": "no such collection"},
    413: {"description": "a file, or the request, is larger than the upload limit"},
    415: {"description": "unsupported file type"},
    507: {"description": "the tenant's storage quota would be passed"},
}


def _check_sizes(request: Request, tenant_name: str, uploads: list[UploadFile], names: list[str]) -> int:
    """Total bytes of the (already spooled) files; 413 for one over the limit, 507 over quota."""
    limit = _limit_bytes(request)
    total = 0
    for up, fname in zip(uploads, names, strict=True):
        size = _spooled_size(up)
        if size > limit:
            raise PayloadTooLarge(
                f"file {fname!r} ({size} bytes) is larger than the upload limit of {limit // (1024 * 1024)} MiB "
                "(TANDEM_RETRIEVAL_MAX_UPLOAD_MB / TANDEM_MAX_UPLOAD_MB)",
                param="file",
                code="file_too_large",
            )
        if size == 0:
            raise InvalidRequest(f"file {fname!r} is empty", param="file", code="empty_file")
        total += size
    settings = request.app.state.settings
    used = folder_bytes(manager(request).tenant_dir(tenant_name))
    check_quota(tenant_name, used, total, settings.tenant_quota_mb, "TANDEM_RETRIEVAL_TENANT_QUOTA_MB")
    return total


def _spooled_size(up: UploadFile) -> int:
    if up.size is not None:
        return int(up.size)
    up.file.seek(0, 2)
    size = up.file.tell()
    up.file.seek(0)
    return size


@router.post(
    "/{name}/files",
    status_code=201,
    response_model=IngestResponse,
    responses={**UPLOAD_ERRORS, **IDEMPOTENCY_RESPONSES},
)
async def upload_files(
    name: str,
    request: Request,
    # Starlette's multipart parser stops at 1,000 files: the same bound, named in the schema
    file: list[UploadFile] = File(
        ...,
        max_length=1000,
        description=".txt .md .html .pdf .docx .pptx .xlsx .csv .tsv .odt .epub .eml .png .jpg .jpeg "
        ".tif .tiff or .jsonl; at most 1,000 files",
    ),
    metadata: str | None = Form(
        None, max_length=65_536, description="JSON object added to every document's metadata"
    ),
) -> JSONResponse:
    """Upload files. The request body streams to disk under the guard's limit; an upload with
    PDF, DOCX, HTML, PPTX, XLSX, ODT, EPUB, EML or an image (read by OCR), or larger than
    TANDEM_RETRIEVAL_ASYNC_UPLOAD_KB, is parsed by the ingestion worker with limits (a 202 job
    whose ``file_errors`` name any file that could not be parsed); small text, Markdown, CSV and
    JSONL files are parsed here, off the event loop, with the same limits (a bad one is a 4xx
    at once), and ingested at once (201). With an
    ``Idempotency-Key`` header a retry returns the first answer."""
    who = tenant(request)
    fingerprint = await run_in_threadpool(
        file_fingerprint, [(up.filename or "", up.file) for up in file], f"{name}\0{metadata or ''}"
    )

    async def create() -> tuple[int, Any]:
        resp = await _upload_files(name, request, file, metadata)
        await audit_request(
            request, "document.upload", name, {"files": [up.filename or "" for up in file][:100]}
        )
        return resp.status_code, json.loads(bytes(resp.body))

    return await idempotent(request, who, create, fingerprint=fingerprint)


async def _upload_files(
    name: str, request: Request, file: list[UploadFile], metadata: str | None
) -> JSONResponse:
    extra: dict[str, Any] = {}
    if metadata:
        try:
            extra = jsonsafe.loads(metadata, where="metadata")
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"metadata: not JSON ({exc.msg})", param="metadata") from None
        if not isinstance(extra, dict):
            raise InvalidRequest("metadata: must be a JSON object", param="metadata")
    col = await run_in_threadpool(collection, request, name)  # 404 before any work
    names = [safe_filename(up.filename or "", param="file") for up in file]
    for fname in names:
        check_supported(fname)
    who = tenant(request)
    total = await run_in_threadpool(_check_sizes, request, who, file, names)
    settings = request.app.state.settings
    # Parsing a large file holds the GIL in long C calls (decoding, regexes, JSON): it would stall
    # the event loop even from a thread, so large uploads are parsed by the worker, like PDFs.
    if total > settings.async_upload_kb * 1024 or any(extension_of(n) in UNTRUSTED for n in names):
        job_id = await run_in_threadpool(
            enqueue_files_job,
            request.app.state.celery,
            request.app.state.jobs,
            col.root,
            who,
            name,
            [(n, up.file) for n, up in zip(names, file, strict=True)],
            extra,
        )
        body = IngestResponse(
            documents=len(names),
            document_ids=[n for n in names if extension_of(n) != ".jsonl"],
            job_id=job_id,
            status_url=f"/v1/jobs/{job_id}",
            events_url=f"/v1/jobs/{job_id}/events",
        )
        return JSONResponse(body.model_dump(), status_code=202)
    parsed: list[InputDocument] = []
    limits = limits_of(manager(request))
    for up, fname in zip(file, names, strict=True):
        data = await run_in_threadpool(_read_spooled, up)
        parsed.extend(await run_in_threadpool(partial(parse_file, fname, data, limits=limits)))
    docs = [InputDocument(p.id, p.text, p.title, {**p.metadata, **extra}, p.structure) for p in parsed]
    if len(docs) > settings.async_documents:
        return await run_in_threadpool(_as_job, request, name, docs, ",".join(names))
    return await run_in_threadpool(_ingest_now, request, name, docs)


def _read_spooled(up: UploadFile) -> bytes:
    up.file.seek(0)
    return up.file.read()


# Documents a page with ``full`` holds at most: each carries its whole text and chunk spans.
FULL_PAGE = 100


@router.get("/{name}/documents", response_model=DocumentPage)
def list_documents(
    col: CollectionDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
    offset: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,  # SQLite integers are 64-bit
    full: Annotated[
        bool,
        Query(
            description=f"each document with its text and chunks, as GET .../documents/{{id}} (at most {FULL_PAGE} a page)"
        ),
    ] = False,
) -> DocumentPage:
    """The collection's documents, a page at a time. ``full`` gives each with its text and
    chunk spans: a client reading the whole collection (an embedder job) asks once a page
    rather than once a document."""
    if full and limit > FULL_PAGE:
        raise InvalidRequest(
            f"limit {limit}: a page with full=true holds at most {FULL_PAGE} documents", param="limit"
        )
    docs, total = col.list_documents(limit, offset)
    if full:
        docs = [d for d in (col.get_document(d.id) for d in docs) if d is not None]
    nxt = offset + len(docs)
    return DocumentPage(
        documents=docs,
        total=total,
        limit=limit,
        offset=offset,
        next_offset=nxt if nxt < total else None,
    )


@router.get("/{name}/documents/{doc_id:path}", response_model=Document)
def get_document(name: CollectionName, doc_id: str, col: CollectionDep) -> Document:
    doc = col.get_document(doc_id)
    if doc is None:
        raise NotFound(f"document {doc_id!r} not found in collection {name!r}", param="id")
    return doc


@router.get(
    "/{name}/originals/{doc_id:path}",
    response_class=FileResponse,
    responses={
        200: {
            "content": {"application/pdf": {}, "image/png": {}, "image/jpeg": {}},
            "description": "the document's original PDF or image (a TIFF's page as PNG)",
        },
        400: {"description": "the TIFF page cannot be converted (too large, too slow, corrupt)"},
    },
)
def get_original(
    name: CollectionName,
    doc_id: str,
    col: CollectionDep,
    page: Annotated[int, Query(ge=1, le=100_000, description="The page of a TIFF to serve (1-based).")] = 1,
) -> FileResponse:
    """The PDF or image a document was parsed from (documents of other formats have none: 404).
    ``page`` picks the page of a multi-page TIFF, served as PNG; other files are served whole."""
    path = find_original(col.root, doc_id)
    if path is None or col.get_document(doc_id) is None:
        raise NotFound(
            f"document {doc_id!r} in collection {name!r} has no original PDF or image",
            param="id",
            code="no_original",
        )
    media_type = MEDIA_TYPES[path.suffix]
    if media_type == "image/tiff":
        path, media_type = tiff_page_png(path, page, doc_id), "image/png"
    return FileResponse(path, media_type=media_type, headers={"Cache-Control": "private, no-store"})


@router.delete("/{name}/documents/{doc_id:path}", status_code=204)
def delete_document(name: CollectionName, doc_id: str, col: CollectionDep, request: Request) -> Response:
    if not col.delete_document(doc_id):
        raise NotFound(f"document {doc_id!r} not found in collection {name!r}", param="id")
    audit_from_thread(request, "document.delete", name, {"document": doc_id})
    return Response(status_code=204)


__all__ = ["manager", "router"]
