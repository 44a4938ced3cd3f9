"""Ingestion jobs: the API side queues them, the ``io`` worker runs them.

Two kinds of input. Documents the request already parsed and validated (JSON documents,
text, Markdown, JSONL) go to ``uploads/<job_id>.jsonl``. Uploaded files the API must not
parse itself (``parsing.UNTRUSTED``: PDF, DOCX, HTML, images read by OCR...: parsers that can
be bombed) go, as received, to ``uploads/<job_id>/`` with a ``manifest.json``; the worker
parses each in a sandboxed child process with limits (core/sandbox.py), and a file that fails
(or yields no text: its ``pages_without_text`` named) is a per-file error in the job's
``file_errors`` while the other files are ingested; the pages of the others without text are
in the job's result (``pages_without_text``, ``page_errors``). The task carries only ids. The worker commits documents in batches, so everything
committed is acknowledged even if the job dies later; re-running a job is idempotent
(content-derived chunk ids make re-ingested chunks no-ops).

A worker runs a job under its lease (``run_leased``: services/common/leases.py). A worker
killed mid-job stops renewing it; every io worker scans now and then (``recover_orphans``)
and puts such a job back on the queue within ``TANDEM_RETRIEVAL_STALE_AFTER_S`` plus a
scan interval, rather than after the broker's visibility timeout (a week).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, cast

from celery import Celery

from services.common.atomic import atomic_write, fsync_path
from services.common.errors import InvalidRequest, TandemError
from services.common.jobs import TERMINAL
from services.common.leases import Heartbeat, JobLeaseSettings
from services.retrieval.core.collection import InputDocument
from services.retrieval.core.jobs import TASK_NAME, Dispatch, FileErrorRow, JobStore, new_job_id
from services.retrieval.core.ocr import OcrSettings
from services.retrieval.core.originals import KEPT, keep_original
from services.retrieval.core.parsing import MIB, UNTRUSTED, NoTextError, ParseLimits, extension_of, parse_file
from services.retrieval.core.registry import CollectionManager
from services.retrieval.core.sandbox import parse_isolated
from services.retrieval.job_results import IngestResult, JobFailed, JobOutcome, PagesWithoutText, SyncResult
from services.retrieval.reindex import KIND as REINDEX
from services.retrieval.reindex import run_reindex
from services.retrieval.sources.store import SYNC_KIND as SYNC

log = logging.getLogger("tandem.retrieval.jobs")

BATCH_DOCS = 32
MANIFEST = "manifest.json"


def enqueue_job(
    celery: Celery,
    jobs: JobStore,
    root: Path,
    tenant: str,
    collection: str,
    docs: list[InputDocument],
    filename: str = "",
) -> str:
    job_id = new_job_id()
    lines = (
        json.dumps(
            {"id": d.id, "text": d.text, "title": d.title, "metadata": d.metadata, "structure": d.structure},
            ensure_ascii=False,
        )
        for d in docs
    )
    atomic_write(root / "uploads" / f"{job_id}.jsonl", ("\n".join(lines) + "\n").encode())
    jobs.create(job_id, tenant, collection, filename=filename, documents=len(docs))
    celery.send_task(TASK_NAME, args=[tenant, collection, job_id], queue="io")
    return job_id


def enqueue_files_job(
    celery: Celery,
    jobs: JobStore,
    root: Path,
    tenant: str,
    collection: str,
    files: list[tuple[str, BinaryIO]],
    metadata: dict[str, Any],
) -> str:
    """Store uploaded files as received (streamed from the request's spool, never in memory
    whole) and queue their parsing and ingestion. Runs in a thread: it writes files."""
    job_id = new_job_id()
    uploads = root / "uploads"
    staging = uploads / f".{job_id}.tmp"
    staging.mkdir(parents=True, exist_ok=True)
    stored = []
    for i, (name, src) in enumerate(files):
        local = f"{i:04d}-{name}"  # two files of one name in one upload stay two files
        src.seek(0)
        with (staging / local).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        stored.append({"name": name, "path": local})
    atomic_write(staging / MANIFEST, json.dumps({"files": stored, "metadata": metadata}).encode())
    os.replace(staging, uploads / job_id)
    fsync_path(uploads)
    jobs.create(job_id, tenant, collection, filename=",".join(f["name"] for f in stored), documents=0)
    celery.send_task(TASK_NAME, args=[tenant, collection, job_id], queue="io")
    return job_id


def limits_of(manager: CollectionManager) -> ParseLimits:
    s = manager.settings
    return ParseLimits(
        max_decompressed_bytes=s.parse_max_decompressed_mb * MIB,
        max_ratio=s.parse_max_ratio,
        max_pages=s.parse_max_pages,
        timeout_s=s.parse_timeout_s,
        max_text_bytes=s.parse_max_decompressed_mb * MIB,
        max_cells=s.parse_max_cells,
    )


def ocr_of(manager: CollectionManager, language: str) -> OcrSettings:
    """How the worker reads pages by OCR for a collection whose ``ocr_language`` is ``language``
    (the settings TANDEM_RETRIEVAL_OCR_*)."""
    s = manager.settings
    return OcrSettings(
        language=language, page_timeout_s=s.ocr_page_timeout_s, max_pixels=s.ocr_max_pixels, dpi=s.ocr_dpi
    )


def parse_stored(
    path: Path,
    name: str,
    limits: ParseLimits,
    *,
    keep_hidden_text: bool = False,
    ocr: OcrSettings | None = None,
) -> list[InputDocument]:
    """The documents of a file on disk named ``name``: PDF, DOCX, HTML, images and the other
    ``UNTRUSTED`` formats parsed in the sandbox (core/sandbox.py), the rest here; scanned PDF
    pages and images read by OCR with ``ocr``. A file that cannot be parsed is a TandemError
    naming it (uploads and synced sources alike); one without text, a ``NoTextError`` naming
    its pages without text."""
    if extension_of(name) in UNTRUSTED:
        return parse_isolated(path, name, limits, keep_hidden_text=keep_hidden_text, ocr=ocr)
    return parse_file(name, path.read_bytes(), limits=limits, keep_hidden_text=keep_hidden_text, ocr=ocr)


def parse_job_files(
    folder: Path,
    limits: ParseLimits,
    originals: Path | None = None,
    *,
    keep_hidden_text: bool = False,
    ocr: OcrSettings | None = None,
) -> tuple[list[InputDocument], list[FileErrorRow]]:
    """(documents, per-file errors) of a files job; the PDFs and images among the files are kept as
    the originals of their documents under the collection folder ``originals`` (core/originals.py).
    Text a reader cannot see is left out of the documents (and counted in each one's
    ``hidden_text_removed``) unless ``keep_hidden_text``; scanned pages and images are read by
    OCR with ``ocr``. The error of a file without text lists its ``pages_without_text``."""
    manifest = json.loads((folder / MANIFEST).read_text())
    extra = manifest.get("metadata") or {}
    docs: list[InputDocument] = []
    errors: list[FileErrorRow] = []
    for entry in manifest["files"]:
        name = entry["name"]
        try:
            parsed = parse_stored(
                folder / entry["path"], name, limits, keep_hidden_text=keep_hidden_text, ocr=ocr
            )
        except TandemError as exc:
            error: FileErrorRow = {
                "filename": name,
                "code": exc.code or "invalid_file",
                "message": exc.message,
            }
            if isinstance(exc, NoTextError) and exc.pages_without_text:
                error["pages_without_text"] = exc.pages_without_text
            errors.append(error)
            continue
        if originals is not None and extension_of(name) in KEPT:
            for p in parsed:
                keep_original(originals, p.id, folder / entry["path"], extension_of(name))
        docs.extend(replace(p, metadata={**p.metadata, **extra}) for p in parsed)
    return docs, errors


def run_job(
    manager: CollectionManager, jobs: JobStore, tenant: str, collection: str, job_id: str
) -> IngestResult | JobFailed:
    """Ingest a queued job's documents, reporting progress in its Redis hash."""
    try:
        col = manager.get(tenant, collection)
        path = col.root / "uploads" / f"{job_id}.jsonl"
        folder = col.root / "uploads" / job_id
        file_errors: list[FileErrorRow] = []
        if folder.is_dir():
            jobs.update(job_id, status="running")
            docs, file_errors = parse_job_files(
                folder,
                limits_of(manager),
                col.root,
                keep_hidden_text=col.config.keep_hidden_text,
                # read afresh: PATCH may have changed it since this worker opened the collection
                ocr=ocr_of(manager, manager.config(tenant, collection).ocr_language),
            )
            jobs.update(job_id, file_errors=file_errors)
            if not docs:
                raise InvalidRequest(
                    "no file could be ingested: " + "; ".join(e["message"] for e in file_errors),
                    param="file",
                )
            path = folder
        elif not path.exists():
            job = jobs.get(job_id)
            if job and job.status == "succeeded":
                # redelivered after it finished: the result it stored then
                return cast(IngestResult, job.result or {})
            raise FileNotFoundError(f"job input {path.name} is gone")
        else:
            docs = [
                InputDocument(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()
            ]
        jobs.update(job_id, status="running", documents_total=len(docs))
        records = col.prepare(docs)
        total = sum(len(r.chunks) for r in records)
        jobs.update(job_id, chunks_total=total)
        done_chunks = done_docs = added = removed = unchanged = 0
        for s in range(0, len(records), BATCH_DOCS):
            batch = records[s : s + BATCH_DOCS]
            batch_chunks = sum(len(r.chunks) for r in batch)
            base = done_chunks

            def progress(done: int, todo: int, base: int = base, n: int = batch_chunks) -> None:
                # Embedding progress within the batch, scaled to its chunk count.
                jobs.update(job_id, chunks_done=base + (n * done // max(todo, 1)))

            res = col.write(batch, progress)
            done_chunks += batch_chunks
            done_docs += len(batch)
            added, removed, unchanged = (
                added + res.chunks_added,
                removed + res.chunks_removed,
                unchanged + res.chunks_unchanged,
            )
            jobs.update(job_id, chunks_done=done_chunks, documents_done=done_docs)
        result: IngestResult = {
            "documents": len(records),
            "chunks_added": added,
            "chunks_removed": removed,
            "chunks_unchanged": unchanged,
            "files_failed": len(file_errors),
            # what the parsers left out as unseen by a reader (core/hidden_text.py says what one is)
            "hidden_text_removed": sum(d.hidden_text_removed for d in docs),
            **pages_without_text(docs),
        }
        jobs.update(job_id, status="succeeded", result=result)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return result
    except TandemError as exc:
        jobs.update(job_id, status="failed", error=exc.message)
        return {"error": exc.message}
    except Exception as exc:
        log.exception("ingestion job %s failed", job_id)
        jobs.update(job_id, status="failed", error=f"{type(exc).__name__}: {exc}")
        raise


def pages_without_text(docs: list[InputDocument]) -> PagesWithoutText:
    """A job result's ``pages_without_text`` (``{document id: [page, ...]}``: the pages of
    each PDF or image where neither its text layer nor OCR found text) and ``page_errors``
    (``{document id: {page: why}}``: where OCR failed, past its time or pixel limit)."""
    blank: dict[str, list[int]] = {}
    why: dict[str, dict[str, str]] = {}
    for d in docs:
        if d.metadata.get("pages_without_text"):
            blank[d.id] = d.metadata["pages_without_text"]
        if d.metadata.get("page_errors"):
            why[d.id] = d.metadata["page_errors"]
    # "pages without text": the same, under the name the job's readers are told to look for
    return {"pages_without_text": blank, "pages without text": blank, "page_errors": why}


# (manager, jobs, tenant, collection, job id) -> the job's result
JobRunner = Callable[[CollectionManager, JobStore, str, str, str], JobOutcome]


def run_leased(
    manager: CollectionManager,
    jobs: JobStore,
    settings: JobLeaseSettings,
    tenant: str,
    collection: str,
    job_id: str,
    owner: str | None = None,
) -> JobOutcome:
    """``run_job`` under the job's lease: a job another live worker holds, or one already
    finished (a redelivered message), is left alone."""
    owner = owner or f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}:{time.time_ns()}"
    raw = jobs.raw(job_id)
    if raw.get("status") in TERMINAL:
        return {"skipped": f"job {job_id} is {raw['status']}"}
    if not jobs.leases.acquire(job_id, owner, settings.stale_after_s):
        log.info("ingestion job %s is held by %s; not running it twice", job_id, jobs.leases.owner(job_id))
        return {"skipped": f"job {job_id} is running elsewhere"}
    try:
        jobs.update(job_id, attempts=int(raw.get("attempts") or 0) + 1)

        def beat(_reacquired: bool) -> None:
            jobs.update(job_id, heartbeat=time.time())

        # The io task runs every kind of retrieval job, so recovery requeues each the same way.
        runners: dict[str, JobRunner] = {REINDEX: run_reindex, SYNC: _run_sync}
        run = runners.get(raw.get("kind", ""), run_job)
        with Heartbeat(
            jobs.leases, job_id, owner, settings.stale_after_s, settings.heartbeat_interval_s, beat
        ):
            return run(manager, jobs, tenant, collection, job_id)
    finally:
        jobs.leases.release(job_id, owner)


def _run_sync(
    manager: CollectionManager, jobs: JobStore, tenant: str, collection: str, job_id: str
) -> SyncResult | JobFailed:
    # Imported here: the sync parses and writes with this module's functions.
    from services.retrieval.sources.sync import run_sync

    return run_sync(manager, jobs, tenant, collection, job_id)


def recover_orphans(jobs: JobStore, settings: JobLeaseSettings, dispatch: Dispatch) -> list[str]:
    """Requeue running ingestion (and reindex) jobs whose lease expired (their worker died); fail those
    requeued ``max_recoveries`` times already."""
    requeued = []
    for job_id in jobs.active_jobs():
        raw = jobs.raw(job_id)
        if not raw or raw.get("status") in TERMINAL:
            jobs.forget_active(job_id)
            continue
        # Queued: waiting for a worker, or taken by one that died before its lease (a moment's
        # window); running with a live lease: its worker is alive.
        if raw.get("status") != "running" or jobs.leases.owner(job_id) is not None:
            continue
        attempts = int(raw.get("attempts") or 0)
        if not jobs.leases.claim_requeue(job_id, attempts):
            continue  # another worker requeued this attempt
        if attempts > settings.max_recoveries:
            jobs.update(job_id, status="failed", error=f"ingestion worker lost {attempts} times; giving up")
            continue
        log.warning(
            "ingestion job %s: worker of attempt %d stopped renewing its lease; requeued", job_id, attempts
        )
        jobs.update(job_id, status="queued")
        dispatch(raw["tenant"], raw["collection"], job_id)
        requeued.append(job_id)
    return requeued
