"""BM25 kept up to date incrementally: never rebuilt per query.

Why not a ``bm25s.BM25`` object per collection: bm25s precomputes every
(document, term) score with the corpus-wide idf and average length baked in,
so one added document changes every stored score and the index would have to
be rebuilt. Here the index keeps what does not change when documents come and
go, and computes BM25 at query time for the query's few terms only:

* a forward index, a CSR matrix over chunk vids (row = chunk, entries = term
  ids and term frequencies), appended to as chunks arrive (O(tokens));
* per-term document frequencies, per-chunk lengths, the live count and total
  length, updated on every add and delete;
* an inverted index, a CSC matrix (column = term) built from the forward index
  by a *merge*: postings of chunks added since the last merge are scanned from
  the CSR tail (vectorised ``np.isin``), and once that tail passes a threshold it
  is merged into the CSC (scipy's C conversion, amortised O(1) per posting).
  Deleted chunks are masked until the next merge drops them.

Scores match ``bm25s`` (method ``lucene``): idf = ln(1 + (N - df + 0.5)/(df + 0.5)),
tf part = tf / (tf + k1·(1 - b + b·len/avglen)); the conformance test compares
the two on the same corpus. Tokenisation is bm25s's (regex, lower case,
stopwords) with a Snowball stemmer from PyStemmer.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence
from typing import Any

import bm25s
import numpy as np
import scipy.sparse as sp

MERGE_MIN_POSTINGS = 50_000


class _Grow:
    """A growable 1-D numpy array (amortised O(1) append)."""

    def __init__(self, dtype: Any, capacity: int = 1024) -> None:
        self.buf = np.zeros(capacity, dtype=dtype)
        self.n = 0

    def reserve(self, extra: int) -> None:
        need = self.n + extra
        if need > len(self.buf):
            new = np.zeros(max(need, 2 * len(self.buf)), dtype=self.buf.dtype)
            new[: self.n] = self.buf[: self.n]
            self.buf = new

    def extend(self, values: np.ndarray) -> None:
        self.reserve(len(values))
        self.buf[self.n : self.n + len(values)] = values
        self.n += len(values)

    def set_len(self, n: int) -> None:
        """Grow to ``n`` (new slots zero)."""
        if n > self.n:
            self.reserve(n - self.n)
            self.buf[self.n : n] = 0
            self.n = n

    @property
    def view(self) -> np.ndarray:
        return self.buf[: self.n]

    @classmethod
    def of(cls, values: np.ndarray) -> _Grow:
        g = cls(values.dtype, max(1024, len(values)))
        g.extend(values)
        return g


class Bm25Tokenizer:
    def __init__(self, language: str = "english") -> None:
        self.language = language
        if language == "none":
            self._stemmer = None
            self._stopwords: str | list[str] = []
        else:
            import Stemmer  # PyStemmer

            self._stemmer = Stemmer.Stemmer(language)
            self._stopwords = "en" if language == "english" else language

    def __call__(self, texts: Sequence[str]) -> list[list[str]]:
        stem = self._stemmer.stemWords if self._stemmer is not None else None
        out = bm25s.tokenize(
            list(texts), stopwords=self._stopwords, stemmer=stem, return_ids=False, show_progress=False
        )
        return [list(t) for t in out]  # type: ignore[union-attr]


class IncrementalBM25:
    """BM25 over chunk vids. Not thread-safe by itself: the collection serialises writers
    against readers."""

    def __init__(self, tokenizer: Bm25Tokenizer, k1: float = 1.2, b: float = 0.75) -> None:
        self.tokenizer = tokenizer
        self.k1 = k1
        self.b = b
        self.vocab: dict[str, int] = {}
        self.df = _Grow(np.int64)
        # Forward index (CSR over vids): row v spans fwd_terms[fwd_ptr[v]:fwd_ptr[v+1]].
        self.fwd_ptr = _Grow(np.int64)
        self.fwd_ptr.extend(np.zeros(1, dtype=np.int64))
        self.fwd_terms = _Grow(np.int32)
        self.fwd_tf = _Grow(np.float32)
        self.doc_len = _Grow(np.float32)
        self.alive = _Grow(np.bool_)
        self.n_live = 0
        self.total_len = 0.0
        # Inverted index of vids < merged_upto.
        self.merged_upto = 0
        self.csc: sp.csc_matrix = sp.csc_matrix((0, 0), dtype=np.float32)
        self._merge_lock = threading.Lock()

    # -- writes -------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return self.fwd_ptr.n - 1

    def add(self, vids: Sequence[int], texts: Sequence[str]) -> None:
        """Append chunks; vids must be increasing and above every vid seen (SQLite AUTOINCREMENT)."""
        if not vids:
            return
        tokens = self.tokenizer(texts)
        for vid, toks in zip(vids, tokens, strict=True):
            if vid < self.n_rows:
                continue  # already seen (a replay overlapping a checkpoint): idempotent
            # Empty rows for vids that were added and deleted before this index saw them.
            gap = vid - self.n_rows
            if gap:
                last = self.fwd_ptr.view[-1]
                self.fwd_ptr.extend(np.full(gap, last, dtype=np.int64))
                self.doc_len.set_len(vid)
                self.alive.set_len(vid)
            ids = np.fromiter((self._term_id(t) for t in toks), dtype=np.int32, count=len(toks))
            uniq, counts = np.unique(ids, return_counts=True)
            self.fwd_terms.extend(uniq.astype(np.int32))
            self.fwd_tf.extend(counts.astype(np.float32))
            self.fwd_ptr.extend(np.array([self.fwd_terms.n], dtype=np.int64))
            self.df.buf[uniq] += 1
            self.doc_len.extend(np.array([len(toks)], dtype=np.float32))
            self.alive.extend(np.array([True]))
            self.n_live += 1
            self.total_len += len(toks)

    def _term_id(self, term: str) -> int:
        tid = self.vocab.get(term)
        if tid is None:
            tid = len(self.vocab)
            self.vocab[term] = tid
            self.df.extend(np.zeros(1, dtype=np.int64))
        return tid

    def remove(self, vids: Sequence[int]) -> None:
        for vid in vids:
            if vid >= self.n_rows or not self.alive.buf[vid]:
                continue
            self.alive.buf[vid] = False
            s, e = self.fwd_ptr.buf[vid], self.fwd_ptr.buf[vid + 1]
            self.df.buf[self.fwd_terms.buf[s:e]] -= 1
            self.n_live -= 1
            self.total_len -= float(self.doc_len.buf[vid])

    def live(self, vids: np.ndarray) -> np.ndarray:
        """Those of ``vids`` this index holds (added and not removed)."""
        present = vids[vids < self.n_rows]
        return present[self.alive.buf[present]] if len(present) else present

    def tail_postings(self) -> int:
        return int(self.fwd_terms.n - self.fwd_ptr.buf[self.merged_upto])

    def needs_merge(self) -> bool:
        tail = self.tail_postings()
        return tail >= MERGE_MIN_POSTINGS and tail >= 0.1 * self.fwd_terms.n

    def merge(self) -> None:
        """Fold the CSR tail into the inverted index and drop deleted rows' postings."""
        n_rows = self.n_rows
        ptr = self.fwd_ptr.view.copy()
        terms = self.fwd_terms.view
        tf = self.fwd_tf.view
        # Zero the postings of deleted rows so the CSC does not carry them.
        row_of = np.repeat(np.arange(n_rows), np.diff(ptr))
        live = self.alive.view[row_of] if n_rows else np.zeros(0, dtype=bool)
        data = np.where(live, tf, 0).astype(np.float32)
        csr = sp.csr_matrix((data, terms, ptr), shape=(n_rows, max(len(self.vocab), 1)))
        csr.eliminate_zeros()
        self.csc = csr.tocsc()
        self.merged_upto = n_rows

    # -- reads --------------------------------------------------------------
    def search(self, query: str, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` (vids, scores) for ``query``; ``allowed`` (sorted vids) restricts the result."""
        if self.n_live == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        toks = self.tokenizer([query])[0]
        q = sorted({self.vocab[t] for t in toks if t in self.vocab})
        q = [t for t in q if self.df.buf[t] > 0]
        if not q:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        qa = np.array(q, dtype=np.int64)
        df = self.df.buf[qa].astype(np.float64)
        idf = np.log(1.0 + (self.n_live - df + 0.5) / (df + 0.5))
        docs_parts: list[np.ndarray] = []
        tf_parts: list[np.ndarray] = []
        idf_parts: list[np.ndarray] = []
        if self.merged_upto and self.csc.shape[1]:
            indptr, indices, data = self.csc.indptr, self.csc.indices, self.csc.data
            for t, w in zip(qa, idf, strict=True):
                if t >= self.csc.shape[1]:
                    continue
                s, e = indptr[t], indptr[t + 1]
                docs_parts.append(indices[s:e])
                tf_parts.append(data[s:e])
                idf_parts.append(np.full(e - s, w))
        tail_start = int(self.fwd_ptr.buf[self.merged_upto])
        tail_terms = self.fwd_terms.buf[tail_start : self.fwd_terms.n]
        if len(tail_terms):
            pos = np.nonzero(np.isin(tail_terms, qa))[0] + tail_start
            if len(pos):
                rows = np.searchsorted(self.fwd_ptr.view, pos, side="right") - 1
                docs_parts.append(rows)
                tf_parts.append(self.fwd_tf.buf[pos])
                idf_parts.append(idf[np.searchsorted(qa, self.fwd_terms.buf[pos])])
        if not docs_parts:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        docs = np.concatenate(docs_parts).astype(np.int64)
        tfs = np.concatenate(tf_parts).astype(np.float64)
        idfs = np.concatenate(idf_parts)
        keep = self.alive.buf[docs]
        if allowed is not None:
            keep &= np.isin(docs, allowed, assume_unique=False)
        docs, tfs, idfs = docs[keep], tfs[keep], idfs[keep]
        if not len(docs):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        avgdl = self.total_len / max(self.n_live, 1)
        norm = self.k1 * (1 - self.b + self.b * self.doc_len.buf[docs] / avgdl)
        contrib = idfs * tfs / (tfs + norm)
        uniq, inv = np.unique(docs, return_inverse=True)
        scores = np.bincount(inv, weights=contrib)
        top = np.argpartition(-scores, k - 1)[:k] if len(uniq) > k else np.arange(len(uniq))
        order = top[np.lexsort((uniq[top], -scores[top]))]
        return uniq[order], scores[order].astype(np.float32)

    # -- checkpoints --------------------------------------------------------
    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        vocab = np.array(sorted(self.vocab, key=self.vocab.__getitem__), dtype=object)
        np.savez(
            buf,
            vocab=np.array([str(v) for v in vocab], dtype=np.str_),
            df=self.df.view,
            fwd_ptr=self.fwd_ptr.view,
            fwd_terms=self.fwd_terms.view,
            fwd_tf=self.fwd_tf.view,
            doc_len=self.doc_len.view,
            alive=self.alive.view,
            stats=np.array([self.n_live, self.total_len, self.k1, self.b], dtype=np.float64),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, raw: bytes, tokenizer: Bm25Tokenizer, k1: float, b: float) -> IncrementalBM25:
        z = np.load(io.BytesIO(raw), allow_pickle=False)
        self = cls(tokenizer, k1, b)
        self.vocab = {str(t): i for i, t in enumerate(z["vocab"])}
        self.df = _Grow.of(z["df"])
        self.fwd_ptr = _Grow.of(z["fwd_ptr"])
        self.fwd_terms = _Grow.of(z["fwd_terms"])
        self.fwd_tf = _Grow.of(z["fwd_tf"])
        self.doc_len = _Grow.of(z["doc_len"])
        self.alive = _Grow.of(z["alive"])
        stats = z["stats"]
        self.n_live = int(stats[0])
        self.total_len = float(stats[1])
        self.merge()
        return self
