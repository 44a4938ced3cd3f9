"""An embedder job's pairs as its collection serves them: ``positives: "chunks"`` and
``hyperparameters.hard_negatives_from: "collection"`` (issue 17).

The retrieval service ranks chunks, not documents: a query lands on one chunk of its document
(the title and headings, then the chunk's text), among the chunks its hybrid search ranks high.
Trained on exactly those texts, the SciFact fine-tune's held-out dense nDCG@10 rose from 0.6846
(whole documents) to 0.7066 (``benchmarks/RESULTS.md``, "fine-tuned embedders").

``POST /v1/jobs`` prepares both, since it reads the collection with the caller's key (which the
worker does not have), and keeps them in the job's work dir (``collection-pairs.json``, written
atomically)::

    {"chunks": {document id: [indexed chunk text, ...]},   every document the job's pairs name
     "negatives": {query: [text, ...]}}                    with hard_negatives_from "collection"

The worker appends each query's negatives to its pairs; the recipe picks each named document's
chunk nearest the query with the job's start model before the first step
(``data/pairs.chunk_positives``). A resumed job trains on the very texts it started with,
however the collection has changed since.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.atomic import atomic_write
from services.common.errors import InvalidRequest
from services.trainer.collection import CollectionDoc, indexed, search
from services.trainer.data.pairs import EmbedderPair, doc_ref, ranked_negatives

if TYPE_CHECKING:
    from services.trainer.protocol import JobCreate
    from services.trainer.state import TrainerState

FILE = "collection-pairs.json"
SEARCH_CONCURRENCY = 4  # searches in flight: the retrieval service answers them on its thread pool
DEPTH = 50  # chunks a query's search returns: the ranks hard negatives are taken from


@dataclass
class ChunkPairs:
    chunks: dict[str, list[str]]  # document id -> the texts its collection indexes for it
    negatives: dict[str, list[str]]  # query -> its negatives from the collection's ranking


def wanted(spec: JobCreate) -> bool:
    return spec.positives == "chunks" or (
        spec.hyperparameters.hard_negatives > 0 and spec.hyperparameters.hard_negatives_from == "collection"
    )


def check_named(records: list[EmbedderPair], docs: dict[str, CollectionDoc], name: str, param: str) -> None:
    """With ``positives: "chunks"`` every labelled pair must name a document of the collection
    (a 400 naming the file's line and the document otherwise)."""
    for rec in records:
        ref = doc_ref(rec)
        if ref is None:
            raise InvalidRequest(
                f"{param}: line {rec['_line']}: positives 'chunks' needs each pair to name its document "
                "(a beir file's qrels, or a pairs row with 'document_id'); this row gives text only",
                param=param,
            )
        if ref not in docs:
            raise InvalidRequest(
                f"{param}: line {rec['_line']}: the positive's document {ref!r} is not a document of "
                f"collection {name!r}, so it has no chunks to train on; ingest it or drop the row",
                param=param,
            )


def prepare(
    st: TrainerState,
    key: str,
    spec: JobCreate,
    labelled: list[EmbedderPair],
    training: list[EmbedderPair],
    docs: dict[str, CollectionDoc],
) -> ChunkPairs:
    """The chunks of the documents ``labelled`` (the job's dataset rows) names, and, with
    ``hard_negatives_from: "collection"``, the negatives of every ``training`` pair's query
    from the collection's own hybrid search, asked with the caller's key."""
    assert spec.collection is not None
    if spec.positives == "chunks":
        check_named(labelled, docs, spec.collection, "dataset")
    refs = dict.fromkeys(doc_ref(rec) for rec in labelled)
    chunks = {ref: [text for _, text in docs[ref].chunks] for ref in refs if ref is not None and ref in docs}
    hp = spec.hyperparameters
    negatives: dict[str, list[str]] = {}
    if hp.hard_negatives > 0 and hp.hard_negatives_from == "collection":
        chunk_text = {cid: text for d in docs.values() for cid, text in d.chunks}
        named: dict[str, set[str]] = {}
        for rec in [*labelled, *training]:  # a query's positives in any of its pairs, held out too
            if (ref := doc_ref(rec)) is not None:
                named.setdefault(rec["query"], set()).add(ref)
        first: dict[str, EmbedderPair] = {}  # a query's first training pair: the text its overlap check reads
        for rec in training:
            first.setdefault(rec["query"], rec)
        top_k = min(100, max(DEPTH, hp.hard_negatives_skip + hp.hard_negatives + 10))

        def mine(query: str) -> list[str]:
            hits = search(st, key, spec.collection or "", query, top_k)
            ranked = [(h.document_id, chunk_text.get(h.chunk_id) or indexed(h.title, h.text)) for h in hits]
            return ranked_negatives(
                ranked,
                named.get(query, set()),
                first[query]["positive"],
                skip=hp.hard_negatives_skip,
                count=hp.hard_negatives,
            )

        with ThreadPoolExecutor(SEARCH_CONCURRENCY) as pool:
            negatives = dict(zip(first, pool.map(mine, list(first)), strict=True))
    return ChunkPairs(chunks, negatives)


def save(work_dir: Path, pairs: ChunkPairs) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(work_dir / FILE, json.dumps({"chunks": pairs.chunks, "negatives": pairs.negatives}).encode())


def load(work_dir: Path) -> ChunkPairs:
    data = json.loads((work_dir / FILE).read_text())
    return ChunkPairs(dict(data["chunks"]), dict(data["negatives"]))


def with_negatives(records: list[EmbedderPair], pairs: ChunkPairs) -> list[EmbedderPair]:
    """``records`` with each query's negatives from the collection after the pair's own. A pair
    whose query found none keeps its own: the batch then uses the fewest any of its rows has."""
    return [
        {**r, "negatives": [*(r.get("negatives") or []), *pairs.negatives.get(r["query"], [])]}
        for r in records
    ]
