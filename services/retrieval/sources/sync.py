"""One sync of a source: an io job of kind ``sync`` (``ingest.run_leased`` runs it under the
job's lease, as it runs ingestion and reindex jobs, so a worker killed mid-sync is replaced).

1. The source's fetcher brings its files to local disk (git.py, web.py, folder.py). A source
   that cannot be read (``SourceError``) fails the job and the collection stays as it was.
2. Each file's sha256 is compared with what the collection holds of it (store.py): a file
   whose content was ingested, or last failed, as it is now is neither parsed nor embedded.
3. New and changed files are parsed as uploads are (``ingest.parse_stored``: the sandbox for
   PDF, DOCX, HTML), chunked and written in batches; a changed file's documents are replaced
   under the same ids. A file that fails is an error of the job (``file_errors`` and
   ``result.errors``) and leaves the collection as it was for that file; the others go on.
4. Files the source no longer has leave the collection (their documents are deleted), except
   those the fetch could not read this time (``Fetch.kept``).

A file's documents are ``<source id>:<path>`` (a file that yields several, such as JSON lines,
adds ``#<id>`` of each, or the part of its id after the file's name). The job's ``result`` counts
``added``, ``changed``, ``removed``, ``failed`` and ``unchanged`` files, with the chunk counts of
an ingestion job; the source's ``last_sync`` keeps the counts and errors, and ``next_sync_at``
is the sync's end plus the source's interval.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from services.common.errors import TandemError
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.collection import ChunkedCollection, InputDocument
from services.retrieval.core.jobs import FileErrorRow, JobStore
from services.retrieval.core.originals import KEPT, keep_original
from services.retrieval.core.parsing import MIB, extension_of
from services.retrieval.core.registry import CollectionManager
from services.retrieval.core.store import DocumentRecord
from services.retrieval.ingest import BATCH_DOCS, limits_of, ocr_of, parse_stored
from services.retrieval.job_results import JobFailed, LastSyncRow, SyncCounts, SyncResult
from services.retrieval.sources.fetched import Fetch, FetchedFile, SourceError, file_error
from services.retrieval.sources.folder import fetch_folder
from services.retrieval.sources.git import fetch_git
from services.retrieval.sources.globs import matcher
from services.retrieval.sources.store import CACHE_DIR, FileState, Source, SourceStore
from services.retrieval.sources.web import fetch_web

log = logging.getLogger("tandem.retrieval.sources")

CountName = Literal["added", "changed", "removed", "failed", "unchanged"]
COUNTS: tuple[CountName, ...] = ("added", "changed", "removed", "failed", "unchanged")
# Errors a source's last_sync keeps (the job's own record has them all).
LAST_SYNC_ERRORS = 50
Clock = Callable[[], float]


def doc_id_of(source_id: str, path: str, name: str, parsed_id: str) -> str:
    """The id of a document a source's file became (see the module's doc)."""
    if parsed_id == name:
        return f"{source_id}:{path}"
    if parsed_id.startswith(name):
        return f"{source_id}:{path}{parsed_id[len(name) :]}"
    return f"{source_id}:{path}#{parsed_id}"


def fetch(source: Source, settings: RetrievalSettings, cache: Path, max_bytes: int) -> Fetch:
    """The source's files now (``SourceError`` when it cannot be read)."""
    wanted = matcher(source.paths)
    roots = settings.source_root_paths()
    if source.type == "git":
        return fetch_git(
            source.url,
            source.branch,
            wanted,
            cache,
            roots=roots,
            allow_private=settings.source_allow_private,
            timeout_s=settings.source_git_timeout_s,
            max_files=settings.source_max_files,
            max_bytes=max_bytes,
        )
    if source.type == "web":
        pages = cache / "web"
        shutil.rmtree(pages, ignore_errors=True)  # a crawl starts from nothing: pages are not diffed on disk
        return fetch_web(
            source.url,
            wanted,
            pages,
            allow_private=settings.source_allow_private,
            max_depth=settings.source_web_max_depth,
            max_pages=min(settings.source_web_max_pages, settings.source_max_files),
            max_bytes=max_bytes,
            timeout_s=settings.source_web_timeout_s,
        )
    return fetch_folder(
        source.url, wanted, roots=roots, max_files=settings.source_max_files, max_bytes=max_bytes
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Pending:
    """Files parsed and chunked, waiting to be written in one batch."""

    records: list[DocumentRecord] = field(default_factory=list)
    states: list[FileState] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # ids a changed file no longer gives


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    errors: list[dict[str, str]] = field(default_factory=list)
    chunks: dict[str, int] = field(
        default_factory=lambda: {"chunks_added": 0, "chunks_removed": 0, "chunks_unchanged": 0}
    )
    documents: int = 0
    hidden_text_removed: int = 0
    pages_without_text: dict[str, list[int]] = field(default_factory=dict)  # by the file's path

    def fail(self, error: dict[str, str]) -> None:
        self.errors.append(error)
        if error["path"]:
            self.counts["failed"] += 1


class Sync:
    def __init__(
        self,
        manager: CollectionManager,
        jobs: JobStore,
        col: ChunkedCollection,
        store: SourceStore,
        source: Source,
        job_id: str,
        max_bytes: int,
    ) -> None:
        self.manager, self.jobs, self.col, self.store = manager, jobs, col, store
        self.source, self.job_id, self.max_bytes = source, job_id, max_bytes
        self.tally = Tally()
        self.done = 0
        self.chunks_done = 0
        self.chunks_total = 0

    def run(self) -> SyncResult:
        cache = self.col.root / CACHE_DIR / self.source.id
        got = fetch(self.source, self.manager.settings, cache, self.max_bytes)
        for error in got.errors:
            self.tally.fail(error)
        known = self.store.files(self.source.id)
        held = sum(1 for k in known.values() if k.sha256 is not None)
        if self.source.type == "folder" and not got.files and not got.kept and held:
            # an unmounted share looks like an empty folder: that is no reason to empty the collection
            raise SourceError(
                f"folder {self.source.url!r} has no files to sync now; the collection keeps the {held} "
                "it has from it (delete the source to remove them)"
            )
        todo: list[tuple[FetchedFile, str, FileState | None]] = []
        unchanged: list[FileState] = []
        for f in got.files:
            sha = sha256_of(f.local)
            prior = known.get(f.path)
            if prior is not None and prior.sha256 == sha:
                self.tally.counts["unchanged"] += 1
                if prior.failed_sha256 is not None:  # back to the content ingested: forget the failure
                    unchanged.append(FileState(f.path, sha, prior.doc_ids))
            elif prior is not None and prior.failed_sha256 == sha:
                self.tally.fail(file_error(f.path, "parse_failed", prior.error or "failed before"))
            else:
                todo.append((f, sha, prior))
        if unchanged:
            self.store.put_files(self.source.id, unchanged)
        present = {f.path for f in got.files}
        removed = sorted(p for p in known if p not in present and p not in got.kept)
        self.jobs.update(self.job_id, documents_total=len(todo) + len(removed))
        pending = Pending()
        for f, sha, prior in todo:
            self.parse(f, sha, prior, pending)
            if len(pending.records) >= BATCH_DOCS:
                self.write(pending)
                pending = Pending()
        self.write(pending)
        self.remove(removed, known)
        if self.source.type == "web":
            shutil.rmtree(cache / "web", ignore_errors=True)  # parsed and written: not needed again
        return self.result(got)

    def parse(self, f: FetchedFile, sha: str, prior: FileState | None, pending: Pending) -> None:
        col = self.col
        try:
            parsed = parse_stored(
                f.local,
                f.name,
                limits_of(self.manager),
                keep_hidden_text=col.config.keep_hidden_text,
                ocr=ocr_of(self.manager, col.config.ocr_language),
            )
            docs = [self.as_document(f, p) for p in parsed]
            records = col.prepare(docs)
        except TandemError as exc:
            self.tally.fail(file_error(f.path, exc.code or "parse_failed", exc.message))
            # the documents of its last good content stay; this content is not parsed again
            state = FileState(
                f.path, prior.sha256 if prior else None, prior.doc_ids if prior else [], sha, exc.message
            )
            self.store.put_files(self.source.id, [state])
            self.progress_file()
            return
        ext = extension_of(f.name)
        if ext in KEPT:  # the file a citation opens (core/originals.py)
            for d in docs:
                keep_original(col.root, d.id, f.local, ext)
        ids = list(dict.fromkeys(d.id for d in docs))
        self.tally.counts["changed" if prior is not None and prior.sha256 else "added"] += 1
        self.tally.hidden_text_removed += sum(d.hidden_text_removed for d in docs)
        pages = [p for d in docs for p in d.metadata.get("pages_without_text") or []]
        if pages:
            self.tally.pages_without_text[f.path] = pages
        pending.records.extend(records)
        pending.states.append(FileState(f.path, sha, ids))
        pending.stale.extend(i for i in (prior.doc_ids if prior else []) if i not in ids)
        self.chunks_total += sum(len(r.chunks) for r in records)
        self.jobs.update(self.job_id, chunks_total=self.chunks_total)

    def as_document(self, f: FetchedFile, p: InputDocument) -> InputDocument:
        metadata = {**p.metadata, **f.metadata, "source": f.path, "source_id": self.source.id}
        title = p.title if p.title != f.name else f.path
        return replace(p, id=doc_id_of(self.source.id, f.path, f.name, p.id), title=title, metadata=metadata)

    def write(self, pending: Pending) -> None:
        if pending.records:
            base = self.chunks_done
            n = sum(len(r.chunks) for r in pending.records)

            def progress(done: int, todo: int) -> None:
                self.jobs.update(self.job_id, chunks_done=base + n * done // max(todo, 1))

            res = self.col.write(pending.records, progress)
            self.chunks_done += n
            self.tally.documents += res.documents
            self.tally.chunks["chunks_added"] += res.chunks_added
            self.tally.chunks["chunks_removed"] += res.chunks_removed
            self.tally.chunks["chunks_unchanged"] += res.chunks_unchanged
        for doc_id in pending.stale:
            self.col.delete_document(doc_id)
        if pending.states:
            # after the documents are committed: a crash between the two parses the files again
            self.store.put_files(self.source.id, pending.states)
        for _ in pending.states:
            self.progress_file()

    def remove(self, paths: list[str], known: dict[str, FileState]) -> None:
        for path in paths:
            for doc_id in known[path].doc_ids:
                self.col.delete_document(doc_id)
            self.store.drop_files(self.source.id, [path])
            if known[path].sha256 is not None:  # a file that only ever failed had nothing to remove
                self.tally.counts["removed"] += 1
            self.progress_file()

    def progress_file(self) -> None:
        self.done += 1
        self.jobs.update(self.job_id, documents_done=self.done, chunks_done=self.chunks_done)

    def result(self, got: Fetch) -> SyncResult:
        t = self.tally
        out: SyncResult = {
            "source_id": self.source.id,
            "added": t.counts["added"],
            "changed": t.counts["changed"],
            "removed": t.counts["removed"],
            "failed": t.counts["failed"],
            "unchanged": t.counts["unchanged"],
            "files": len(got.files),
            "documents": t.documents,
            "chunks_added": t.chunks["chunks_added"],
            "chunks_removed": t.chunks["chunks_removed"],
            "chunks_unchanged": t.chunks["chunks_unchanged"],
            "hidden_text_removed": t.hidden_text_removed,
            "errors": t.errors,
        }
        if got.commit is not None:
            out["commit"] = got.commit
        if t.pages_without_text:
            out["pages without text"] = t.pages_without_text
        return out


def _last_sync(
    job_id: str,
    status: str,
    started: float,
    finished: float,
    result: SyncCounts | None,
    error: str | None,
) -> LastSyncRow:
    """``result``: what the sync did, None when it failed before it had anything to count."""
    out: LastSyncRow = {
        "job_id": job_id,
        "status": status,
        "started_at": started,
        "finished_at": finished,
        "counts": {k: result[k] if result is not None else 0 for k in COUNTS},
        "errors": result["errors"][:LAST_SYNC_ERRORS] if result is not None else [],
        "error": error,
    }
    if result is not None and "commit" in result:
        out["commit"] = result["commit"]
    return out


def next_sync(source: Source, finished: float) -> float | None:
    return finished + source.interval_minutes * 60 if source.interval_minutes else None


def run_sync(
    manager: CollectionManager,
    jobs: JobStore,
    tenant: str,
    collection: str,
    job_id: str,
    *,
    clock: Clock = time.time,
) -> SyncResult | JobFailed:
    """Run the sync job ``job_id`` (see the module's doc); its outcome goes to the job and to
    the source's ``last_sync``."""
    started = clock()
    store: SourceStore | None = None
    source: Source | None = None
    sync: Sync | None = None
    try:
        col = manager.get(tenant, collection)
        store = SourceStore(col.root, collection)
        source = store.get(jobs.raw(job_id).get("source_id", ""))
        jobs.update(job_id, status="running")
        sync = Sync(manager, jobs, col, store, source, job_id, manager.settings.source_max_file_mb * MIB)
        result = sync.run()
        file_errors: list[FileErrorRow] = [
            {"filename": e["path"], "code": e["code"], "message": e["message"]}
            for e in result["errors"]
            if e["path"]
        ]
        finished = clock()
        store.finish(
            source.id,
            job_id,
            _last_sync(job_id, "succeeded", started, finished, result, None),
            next_sync(source, finished),
        )
        jobs.update(job_id, status="succeeded", result=result, file_errors=file_errors)
        log.info("sync job %s of source %s: %s", job_id, source.id, {k: result[k] for k in COUNTS})
        return result
    except (SourceError, TandemError) as exc:
        message = exc.message if isinstance(exc, TandemError) else str(exc)
        _failed(jobs, job_id, store, source, sync, started, clock(), message)
        return {"error": message}
    except Exception as exc:
        log.exception("sync job %s failed", job_id)
        _failed(jobs, job_id, store, source, sync, started, clock(), f"{type(exc).__name__}: {exc}")
        raise


def _failed(
    jobs: JobStore,
    job_id: str,
    store: SourceStore | None,
    source: Source | None,
    sync: Sync | None,
    started: float,
    finished: float,
    message: str,
) -> None:
    """The sync ends failed: what it did before (a failure after the fetch) is counted."""
    result: SyncCounts | None = None
    if sync is not None and source is not None:
        counts = sync.tally.counts
        result = {
            "source_id": source.id,
            "added": counts["added"],
            "changed": counts["changed"],
            "removed": counts["removed"],
            "failed": counts["failed"],
            "unchanged": counts["unchanged"],
            "errors": sync.tally.errors,
        }
    jobs.update(job_id, status="failed", error=message, result=result)
    if store is not None and source is not None:
        store.finish(
            source.id,
            job_id,
            _last_sync(job_id, "failed", started, finished, result, message),
            next_sync(source, finished),
        )
