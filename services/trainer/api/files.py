"""``/v1/files``: dataset uploads, validated on upload."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any

from fastapi import APIRouter, File, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from services.common.auth import principal_of
from services.common.errors import InvalidRequest, PayloadTooLarge
from services.common.idempotency import idempotent
from services.common.paths import safe_filename
from services.common.quota import check_quota
from services.trainer.api.deps import TrainerState, state_of
from services.trainer.data.formats import DatasetError, parse_dataset
from services.trainer.protocol import FileObject
from services.trainer.runner import dataset_path
from services.trainer.store import new_id

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


def _store_upload(st: TrainerState, tenant: str, upload: UploadFile, name: str) -> dict[str, Any]:
    """Check, copy and parse a spooled upload (in a thread: file I/O and parsing stay off the loop)."""
    limit = st.settings.max_dataset_mb * 1024 * 1024
    src = upload.file
    src.seek(0, os.SEEK_END)
    size = src.tell()
    src.seek(0)
    if size > limit:
        raise PayloadTooLarge(
            f"file: {name!r} ({size} bytes) is larger than {st.settings.max_dataset_mb} MiB "
            "(TANDEM_TRAINER_MAX_DATASET_MB)",
            param="file",
        )
    used = sum(int(f.get("bytes", 0) or 0) for f in st.store.list_files(tenant))
    check_quota(tenant, used, size, st.settings.tenant_quota_mb, "TANDEM_TRAINER_TENANT_QUOTA_MB")
    fid = new_id("file")
    path = dataset_path(st.common, tenant, fid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    try:
        data = tmp.read_bytes()
        if not data.strip():
            raise InvalidRequest("file: the file is empty", param="file")
        try:
            parsed = parse_dataset(data, max_rows=st.settings.max_dataset_rows)
        except DatasetError as exc:
            raise InvalidRequest(
                f"file {name!r}: {exc}", param=exc.field or "file", code="invalid_dataset"
            ) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    record = {
        "id": fid,
        "filename": name,
        "bytes": size,
        "rows": len(parsed.records),
        "format": parsed.format,
        "kinds": list(parsed.kinds),
        "created_at": time.time(),
    }
    st.store.add_file(tenant, record)
    return record


@router.post("/files", status_code=201, response_model=FileObject, responses=UPLOAD_ERRORS)
async def upload_file(request: Request, file: UploadFile = File(...)) -> Any:
    """Upload a JSONL dataset; every line is parsed and checked before it is stored.

    The body streams to disk under the guard's limit (TANDEM_TRAINER_MAX_DATASET_MB); an
    ``Idempotency-Key`` header makes a retry return the first upload's file."""
    tenant = principal_of(request).tenant
    st = state_of(request)
    name = safe_filename(file.filename or "dataset.jsonl", param="file")

    async def create() -> tuple[int, Any]:
        record = await run_in_threadpool(_store_upload, st, tenant, file, name)
        obj = file_object({k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in record.items()})
        return 201, obj.model_dump()

    return await idempotent(request, tenant, create, fingerprint=f"{name}:{_spooled_digest(file)}")


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
def list_files(request: Request) -> dict[str, object]:
    st = state_of(request)
    return {
        "object": "list",
        "data": [file_object(d) for d in st.store.list_files(principal_of(request).tenant)],
    }


@router.get("/files/{file_id}", response_model=FileObject)
def get_file(file_id: str, request: Request) -> FileObject:
    st = state_of(request)
    return file_object(st.store.get_file(principal_of(request).tenant, file_id))
