"""Checking and keeping a tenant's dataset files: the API's uploads, and the files a job's
worker writes (its generated questions).

A file is copied to disk, parsed (a bad row is a 400 naming its line) and recorded in the
job store with the kinds of job it suits.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from typing import BinaryIO

from services.common.errors import InvalidRequest, PayloadTooLarge
from services.common.quota import check_quota
from services.trainer.data.formats import BeirPartError, DatasetError, beir_upload, parse_dataset
from services.trainer.paths import dataset_path
from services.trainer.state import TrainerState
from services.trainer.store import FileRecord, new_id


def store_upload(
    st: TrainerState, tenant: str, src: BinaryIO, name: str, *, file_id: str | None = None
) -> FileRecord:
    """Check, copy and parse a spooled upload (in a thread: file I/O and parsing stay off the loop);
    ``file_id``: the id to save it as (the worker saving a job's questions where the job said)."""
    limit = st.settings.max_dataset_mb * 1024 * 1024
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
    fid = file_id or new_id("file")
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
    record: FileRecord = {
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


def store_beir_upload(
    st: TrainerState,
    tenant: str,
    qrels: BinaryIO,
    corpus: tuple[str, BinaryIO] | None,
    queries: tuple[str, BinaryIO] | None,
    name: str,
) -> FileRecord:
    """BEIR's qrels TSV with its corpus and queries JSONL, checked and stored as one ``beir`` file
    (see ``formats.beir_upload``); a bad row is a 400 naming the part and its line."""
    missing = [p for p, f in (("corpus", corpus), ("queries", queries)) if f is None]
    if missing:
        raise InvalidRequest(
            f"{missing[0]}: a BEIR upload is the qrels TSV as 'file' with BEIR's corpus.jsonl as 'corpus' "
            "and queries.jsonl as 'queries'; give both",
            param=missing[0],
        )
    assert corpus is not None and queries is not None
    try:
        data = beir_upload(qrels.read(), corpus[1].read(), queries[1].read())
    except BeirPartError as exc:
        label = {"file": name, "corpus": corpus[0], "queries": queries[0]}[exc.part]
        raise InvalidRequest(
            f"{exc.part} {label!r}: {exc.error}",
            param=exc.part if exc.error.field is None else f"{exc.part}.{exc.error.field}",
            code="invalid_dataset",
        ) from None
    return store_upload(st, tenant, io.BytesIO(data), name)
