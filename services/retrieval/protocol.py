"""Wire models of the retrieval API (``/v1``). Other services use these shapes over HTTP."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, computed_field

from services.common.bounds import NAME_CHARS, TEXT_CHARS, JsonBound, JsonSmall
from services.common.jobs import JobStatus

# Documents of one POST .../documents (a larger batch: several requests, or a file upload).
MAX_DOCUMENTS = 10_000

SearchMode = Literal["dense", "sparse", "hybrid"]
IndexKind = Literal["auto", "flat", "hnsw", "ivf"]
EmbeddingBackendName = Literal["torch", "onnx", "onnx-int8"]


class Chunking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    size: StrictInt = Field(..., ge=16, le=8192, description="Chunk size in tokens of the embedding model.")
    overlap: StrictInt = Field(0, ge=0, le=4096, description="Tokens shared by consecutive chunks.")


class CreateCollection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=64)
    embedding_model: str | None = Field(None, max_length=NAME_CHARS)
    chunking: Chunking | None = None
    index: IndexKind | None = None
    embedding_backend: EmbeddingBackendName | None = Field(
        None,
        description="How the collection's documents and queries are embedded: 'torch', 'onnx' "
        "(ONNX Runtime fp32) or 'onnx-int8' (dynamic int8, faster on CPU); fixed at creation. "
        "Default: TANDEM_RETRIEVAL_EMBEDDING_BACKEND.",
    )
    keep_hidden_text: StrictBool = Field(
        False,
        description="Keep the text of uploaded files that a reader cannot see (hidden HTML elements, "
        "text in its background's colour, hidden Word runs, PDF text off the page or in the page's "
        "colour). By default it is left out and counted in the job's result as hidden_text_removed.",
    )
    ocr_language: str = Field(
        "en",
        min_length=1,
        max_length=16,
        description="Language of the text OCR reads in this collection's scanned PDF pages and PNG, "
        "JPEG and TIFF files: 'en' (English) or 'zh' (Chinese, with English), what the installed "
        "recognition model reads; another value is a 400 naming the choices.",
    )


class ReindexInfo(BaseModel):
    job_id: str
    embedder: str
    index_version: int


class CollectionInfo(BaseModel):
    name: str
    embedding_model: str
    embedding_backend: str = "torch"
    dimension: int
    chunking: Chunking
    keep_hidden_text: bool = False
    ocr_language: str = "en"
    index: str
    index_type: str | None = None
    documents: int | None = None
    chunks: int | None = None
    indexed: dict[str, int] | None = Field(None, description="Chunks in the dense and sparse indexes.")
    created_at: float
    # Index versions (shown by GET /v1/collections/{name} on the embedded backend).
    embedder: str | None = Field(
        None, description="The embedder of the active index version (embedding_model until a switch)."
    )
    index_version: int | None = Field(None, description="The active index version (1 as created).")
    previous_version: int | None = Field(None, description="The version a rollback returns to.")
    previous_embedder: str | None = None
    reindexing: ReindexInfo | None = Field(None, description="The reindex under way, if any.")


class GateQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: str = Field(min_length=1, max_length=4000)
    relevant: list[Annotated[str, Field(max_length=512)]] = Field(
        min_length=1, max_length=100, description="Ids of the documents that answer the query."
    )


class ReindexGate(BaseModel):
    """Held-out queries a new index version must rank better than the active one before the
    collection switches to it."""

    model_config = ConfigDict(extra="forbid")
    queries: list[GateQuery] = Field(min_length=1, max_length=5000)
    mode: Literal["hybrid", "dense"] = Field(
        "hybrid", description="The search mode scored (hybrid: as users search by default)."
    )
    min_gain: StrictFloat = Field(
        0.0, ge=0.0, le=1.0, description="nDCG@10 the new version must gain over the active one."
    )


class UpdateCollection(BaseModel):
    """``PATCH /v1/collections/{name}``: what to change: the embedder (a reindex job), the OCR
    language (at once, for files ingested from then on), or both."""

    model_config = ConfigDict(extra="forbid")
    embedder: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="A base model name (as embedding_model) or one of the tenant's fine-tuned "
        "embedders (ft-emb-...): the collection is re-embedded into a new index version.",
    )
    only_if_better: ReindexGate | None = Field(
        None,
        description="Switch only if the new version's nDCG@10 (by document) on these queries beats "
        "the active version's by more than min_gain; otherwise the new version is dropped. The "
        "reindex job's result holds applied, before, after and the reason.",
    )
    ocr_language: str | None = Field(
        None,
        min_length=1,
        max_length=16,
        description="The language OCR reads in files ingested from now on ('en' or 'zh'; see "
        "CreateCollection.ocr_language). Alone, the answer is 200 with the collection.",
    )


class ReindexResponse(BaseModel):
    """202: the reindex job; the collection switches when it succeeds."""

    job_id: str
    collection: str
    embedder: str
    index_version: int = Field(description="The version being built.")
    status_url: str
    events_url: str


class CollectionList(BaseModel):
    collections: list[CollectionInfo]


class CollectionAccess(BaseModel):
    """A collection's access list as ``GET``/``PUT /v1/collections/{name}/access`` answer it."""

    collection: str
    open: bool = Field(
        description="true: the collection has no access list, so its whole tenant reads it (and every "
        "key or user that may write at all writes it)"
    )
    readers: list[str] = Field(description="user:<id>, group:<name> or key:<id>; writers read too")
    writers: list[str]
    updated_at: float | None = Field(None, description="unix seconds of the last change")


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(..., min_length=1, max_length=512)
    text: str = Field(..., min_length=1, max_length=TEXT_CHARS)
    title: str | None = Field(None, max_length=2048)
    metadata: JsonSmall | None = Field(
        None, description="At most 1,000 values in all, strings of at most 65,536 characters."
    )


class AddDocuments(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: list[DocumentIn] = Field(..., min_length=1, max_length=MAX_DOCUMENTS)


class IngestResponse(BaseModel):
    """201 for a synchronous ingestion, 202 (with ``job_id``) when it became a job."""

    documents: int = 0
    document_ids: list[str] = Field(default_factory=list)
    chunks_added: int = 0
    chunks_removed: int = 0
    chunks_unchanged: int = 0
    job_id: str | None = None
    status_url: str | None = None
    events_url: str | None = None


class Located(BaseModel):
    """Where a chunk is in its document (from its parser: see services/retrieval/core/structure.py).
    Empty for a document without headings, pages or anchors."""

    section: str = Field(default="", description="Heading path of the chunk's section ('Guide > Install').")
    headings: list[str] = Field(default_factory=list, description="The heading path as a list.")
    section_start: int | None = Field(
        default=None, description="Offset of the enclosing section in the document."
    )
    section_end: int | None = Field(default=None, description="End offset of the enclosing section.")
    pages: list[int] = Field(default_factory=list, description="PDF pages (1-based) the chunk is on.")
    page_starts: list[int] = Field(
        default_factory=list,
        description="Document offset at which each of 'pages' begins within the chunk (the first is 'start').",
    )
    anchor: str | None = Field(
        default=None, description="HTML id of the chunk's section heading ('#anchor')."
    )
    boxes: list[list[int | float]] = Field(
        default_factory=list,
        description="Line boxes of PDF and image chunks: [start, end, page, x0, top, x1, bottom], "
        "offsets into the chunk's text, the 1-based page, the box in page units from its top-left.",
    )
    page_sizes: list[list[int | float]] = Field(
        default_factory=list, description="[page, width, height] of the pages the boxes are on."
    )
    table_header: str | None = Field(
        default=None,
        description="For a chunk of a long table's rows after its first piece: the table's header "
        "row and its '| --- |' line, which the chunk's text does not repeat.",
    )


LOCATED_FIELDS = tuple(Located.model_fields)


def located(structure: dict[str, Any]) -> dict[str, Any]:
    """The ``Located`` fields of a chunk's stored structure (unknown keys dropped)."""
    return {k: structure[k] for k in LOCATED_FIELDS if structure.get(k) is not None}


class ChunkSpan(Located):
    chunk_id: str
    start: int
    end: int
    # the title and section headings indexed with the chunk's text ("<context>\n<text>" is what
    # is embedded and BM25-indexed; empty for a document without either)
    context: str = ""


class Document(BaseModel):
    id: str
    title: str
    metadata: dict[str, Any]
    chunks: int
    created_at: float
    updated_at: float
    text: str | None = None
    chunk_list: list[ChunkSpan] | None = None


class DocumentPage(BaseModel):
    documents: list[Document]
    total: int
    limit: int
    offset: int
    next_offset: int | None


# A search filter's own limits (256 conditions, 1,024 values in one $in list: core/filters.py)
# are checked by its parser and name the condition; this bound only keeps the walk to them
# finite, above what those limits let through.
Filters = Annotated[dict[str, Any], JsonBound(values=1_000_000, chars=65_536)]


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # Emptiness is checked in the route: the shared validation message drops a field named "query".
    query: str = Field(..., max_length=8192)
    top_k: StrictInt = Field(10, ge=1, le=100)
    mode: SearchMode = "hybrid"
    filters: Filters | None = Field(
        None,
        description="At most 256 conditions and 1,024 values in one $in/$nin list; strings of "
        "at most 65,536 characters.",
    )
    rerank: StrictBool = False
    weights: (
        dict[Literal["dense", "sparse"], Annotated[float, Field(strict=True, ge=0.0, le=100.0)]] | None
    ) = Field(
        None,
        max_length=2,
        description="RRF weights of the rankings in hybrid mode, each 0 to 100 (defaults from settings).",
    )
    section_tokens: StrictInt | None = Field(
        default=None,
        ge=16,
        le=8192,
        description="Also return each hit's enclosing section (section_text), at most this many tokens "
        "of the collection's embedding model around the chunk: small chunks are what is ranked, the "
        "section is what a reader (or a model) reads.",
    )
    sentences: StrictBool = Field(
        default=False,
        description="Also return each hit's candidate answer sentences (of its section with "
        "section_tokens) and the heading path they are read under, each scored by the cosine of its "
        "embedding to the query's with the collection's own embedder: a reader picks among them "
        "without embedding them again.",
    )
    sentence_query: str | None = Field(
        default=None,
        max_length=8192,
        description="What the sentences are scored against (default: query): a reader may read the "
        "question otherwise than the search does (e.g. without a follow-up's added words).",
    )


class ScoredSentence(BaseModel):
    """A sentence of a hit that can stand as an answer, as a reader reads it (services/common/
    candidates.py), and its cosine to the query."""

    position: int = Field(description="Its place among the hit's sentences.")
    text: str
    score: float


class SearchResult(Located):
    chunk_id: str
    document_id: str
    text: str
    score: float
    scores: dict[str, float]
    metadata: dict[str, Any]
    title: str = ""
    start: int
    end: int
    # Only with the request's section_tokens: the enclosing section around the chunk, and where
    # it starts in the document (section_text == document.text[section_text_start:...]).
    section_text: str | None = None
    section_text_start: int | None = None
    # Only with the request's sentences: the hit's candidate answer sentences, and the heading path
    # (else the title) they are read under with its cosine to the query.
    sentences: list[ScoredSentence] | None = None
    context: str | None = None
    context_score: float | None = None


class SearchResponse(BaseModel):
    results: list[SearchResult]
    mode: SearchMode
    took_ms: float


class FileError(BaseModel):
    """A file of an upload job that could not be ingested (the job's other files were)."""

    filename: str
    code: str
    message: str
    pages_without_text: list[int] = Field(
        default_factory=list,
        description="For a PDF or image without any text: its pages, none of which had a text layer "
        "or text OCR could read (the message says why OCR failed on a page).",
    )

    @computed_field(alias="pages without text")  # type: ignore[prop-decorator]
    @property
    def pages_without_text_named(self) -> list[int]:
        """``pages_without_text`` under the name the job's readers are told to look for."""
        return self.pages_without_text


class Job(BaseModel):
    id: str
    collection: str
    kind: Literal["ingest", "reindex", "sync"] = "ingest"
    status: JobStatus
    chunks_done: int
    chunks_total: int
    documents_done: int
    documents_total: int
    error: str | None = None
    result: dict[str, Any] | None = None
    file_errors: list[FileError] = Field(default_factory=list)
    filename: str | None = None
    source_id: str | None = Field(None, description="The source a sync job reads (kind 'sync').")
    created_at: float
    updated_at: float

    # Marked deprecated in the schema only: pydantic's ``deprecated=`` would warn on every dump.
    @computed_field(  # type: ignore[prop-decorator]
        description="Deprecated: use 'status' (every service's jobs use it); kept for older clients.",
        json_schema_extra={"deprecated": True},
    )
    @property
    def state(self) -> JobStatus:
        return self.status


# -- sources a collection follows (services/retrieval/sources/) --------------------------------

SourceTypeName = Literal["git", "web", "folder"]
# Sources are few and small: these bounds are far above what a real one needs.
MAX_SOURCE_GLOBS = 64
MAX_INTERVAL_MINUTES = 10_080  # a week


class CreateSource(BaseModel):
    """``POST /v1/collections/{name}/sources``."""

    model_config = ConfigDict(extra="forbid")
    type: SourceTypeName = Field(
        description="'git' (a repository: https://, http:// or file:// URL), 'web' (a site: its "
        "start URL) or 'folder' (a folder on the server: an absolute path or file:// URL)."
    )
    url: str = Field(min_length=1, max_length=2048)
    branch: str | None = Field(
        None, min_length=1, max_length=255, description="git only: the branch (default: the repository's)."
    )
    paths: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=lambda: ["**"],
        max_length=MAX_SOURCE_GLOBS,
        description="Globs of the files to take, relative to the source's root ('docs/**/*.md'; "
        "'**' spans folders, '*' does not): for a website, of its pages' URL paths. Default: all.",
    )
    interval_minutes: StrictInt = Field(
        60,
        ge=0,
        le=MAX_INTERVAL_MINUTES,
        description="Minutes between scheduled syncs (at least TANDEM_RETRIEVAL_SOURCE_MIN_INTERVAL_MINUTES); "
        "0: only on demand.",
    )


class SyncErrorInfo(BaseModel):
    path: str = Field(description="The file (or page path) that failed; empty for the whole source.")
    code: str
    message: str


class SyncCounts(BaseModel):
    added: int = 0
    changed: int = 0
    removed: int = 0
    failed: int = 0
    unchanged: int = 0


class LastSync(BaseModel):
    job_id: str
    status: JobStatus
    started_at: float
    finished_at: float | None = None
    counts: SyncCounts = Field(default_factory=SyncCounts)
    errors: list[SyncErrorInfo] = Field(default_factory=list, description="At most the first 50.")
    error: str | None = Field(None, description="Why the sync failed (the source could not be read).")
    commit: str | None = Field(None, description="git: the commit synced.")


class SourceInfo(BaseModel):
    id: str
    collection: str
    type: SourceTypeName
    url: str
    branch: str | None = None
    paths: list[str]
    interval_minutes: int
    created_at: float
    next_sync_at: float | None = Field(
        None, description="When the next scheduled sync starts (None: on demand only)."
    )
    last_sync: LastSync | None = None
    syncing_job: str | None = Field(None, description="The sync job queued or running now.")
    files: int = Field(0, description="Files of the source in the collection.")
    documents: int = Field(0, description="Documents those files became.")


class SourceList(BaseModel):
    sources: list[SourceInfo]


class SyncStarted(BaseModel):
    """202: the sync job (``GET /v1/jobs/{job_id}``)."""

    job_id: str
    source_id: str
    already_running: bool = Field(False, description="The source was syncing: this is that job.")
    status_url: str
    events_url: str
