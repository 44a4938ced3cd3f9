"""``/v1/files``: dataset uploads, validated on upload."""

from __future__ import annotations

import json
import os
import time

from fastapi import APIRouter, File, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from services.common.auth import principal_of
from services.common.errors import InvalidRequest, PayloadTooLarge
from services.common.paths import safe_filename
from services.trainer.api.deps import state_of
from services.trainer.data.formats import DatasetError, parse_dataset
from services.trainer.protocol import FileObject
from services.trainer.runner import dataset_path
from services.trainer.store import new_id

router = APIRouter(prefix="/v1", tags=["files"])


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


@router.post("/files", status_code=201, response_model=FileObject)
async def upload_file(request: Request, file: UploadFile = File(...)) -> FileObject:
    """Upload a JSONL dataset; every line is parsed and checked before it is stored."""
    tenant = principal_of(request).tenant
    st = state_of(request)
    name = safe_filename(file.filename or "dataset.jsonl", param="file")
    limit = st.settings.max_dataset_mb * 1024 * 1024
    data = await file.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"file: larger than {st.settings.max_dataset_mb} MiB", param="file")
    if not data.strip():
        raise InvalidRequest("file: the file is empty", param="file")
    try:
        parsed = await run_in_threadpool(parse_dataset, data, max_rows=st.settings.max_dataset_rows)
    except DatasetError as exc:
        raise InvalidRequest(
            f"file {name!r}: {exc}", param=exc.field or "file", code="invalid_dataset"
        ) from None
    fid = new_id("file")
    path = dataset_path(st.common, tenant, fid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    record = {
        "id": fid,
        "filename": name,
        "bytes": len(data),
        "rows": len(parsed.records),
        "format": parsed.format,
        "kinds": list(parsed.kinds),
        "created_at": time.time(),
    }
    await run_in_threadpool(st.store.add_file, tenant, record)
    return file_object({k: json.dumps(v) if isinstance(v, list) else str(v) for k, v in record.items()})


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
