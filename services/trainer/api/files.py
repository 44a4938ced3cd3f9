"""``/v1/files``: dataset uploads, validated on upload."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, BinaryIO

from fastapi import APIRouter, File, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from services.common.idempotency import idempotent
from services.common.paths import safe_filename
from services.trainer import uploads
from services.trainer.api.deps import TenantDep, TrainerDep
from services.trainer.protocol import FileObject

router = APIRouter(prefix="/v1", tags=["files"], responses={404: {"description": "no such file"}})


def file_object(data: dict[str, str]) -> FileObject:
    return FileObject(
        id=data["id"],
        filename=data["filename"],
        bytes=int(data["bytes"]),
        rows=int(data["rows"]),
        format=data["format"],
        kinds=json.loads(data["kinds"]),
        created_at=float(data["created_at"]),
    )


UPLOAD_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "the dataset is invalid (the message names the line and the field)"},
    401: {"description": "missing or unknown API key"},
    409: {"description": "Idempotency-Key reused with a different request"},
    413: {"description": "the file is larger than TANDEM_TRAINER_MAX_DATASET_MB"},
    507: {"description": "the tenant's storage quota (TANDEM_TRAINER_TENANT_QUOTA_MB) would be passed"},
}


@router.post("/files", status_code=201, response_model=FileObject, responses=UPLOAD_ERRORS)
async def upload_file(
    request: Request,
    st: TrainerDep,
    tenant: TenantDep,
    file: UploadFile = File(
        ..., description="a JSONL dataset, or BEIR's qrels TSV with 'corpus' and 'queries'"
    ),
    corpus: UploadFile | None = File(
        None, description="with a qrels TSV as 'file': BEIR's corpus.jsonl ({_id, title?, text} rows)"
    ),
    queries: UploadFile | None = File(
        None, description="with a qrels TSV as 'file': BEIR's queries.jsonl ({_id, text} rows)"
    ),
) -> Any:
    """Upload a JSONL dataset; every line is parsed and checked before it is stored.

    BEIR's own files are accepted too: the qrels TSV (``query-id<TAB>corpus-id<TAB>score``,
    header optional) as ``file`` with ``corpus`` and ``queries``; they are stored as one
    ``beir`` file (every document, the queries the qrels name, the qrels), and a bad row is a
    400 naming the part (``param``) and its line.

    The body streams to disk under the guard's limit (TANDEM_TRAINER_MAX_DATASET_MB); an
    ``Idempotency-Key`` header makes a retry return the first upload's file."""
    name = safe_filename(file.filename or "dataset.jsonl", param="file")
    # a .tsv is BEIR's qrels: alone it is refused for want of its corpus and queries
    tsv = corpus is not None or queries is not None or name.lower().endswith(".tsv")
    beir = (corpus, queries) if tsv else None

    def part(upload: UploadFile | None, default: str) -> tuple[str, BinaryIO] | None:
        return None if upload is None else (upload.filename or default, upload.file)

    async def create() -> tuple[int, Any]:
        if beir is None:
            record = await run_in_threadpool(uploads.store_upload, st, tenant, file.file, name)
        else:
            record = await run_in_threadpool(
                uploads.store_beir_upload,
                st,
                tenant,
                file.file,
                part(beir[0], "corpus.jsonl"),
                part(beir[1], "queries.jsonl"),
                name,
            )
        obj = file_object({k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in record.items()})
        return 201, obj.model_dump()

    parts = [file, *(p for p in beir or () if p is not None)]
    fingerprint = f"{name}:" + ":".join(_spooled_digest(p) for p in parts)
    return await idempotent(request, tenant, create, fingerprint=fingerprint)


def _spooled_digest(upload: UploadFile) -> str:
    """The upload's size and first MiB: enough to tell a retry from a different file."""
    src = upload.file
    src.seek(0, os.SEEK_END)
    size = src.tell()
    src.seek(0)
    head = src.read(1 << 20)
    src.seek(0)
    return f"{size}:{hashlib.sha256(head).hexdigest()}"


@router.get("/files")
def list_files(st: TrainerDep, tenant: TenantDep) -> dict[str, object]:
    return {"object": "list", "data": [file_object(d) for d in st.store.list_files(tenant)]}


@router.get("/files/{file_id}", response_model=FileObject)
def get_file(file_id: str, st: TrainerDep, tenant: TenantDep) -> FileObject:
    return file_object(st.store.get_file(tenant, file_id))
