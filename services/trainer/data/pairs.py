"""Training pairs and held-out retrieval sets of ``embedder`` jobs.

Three sources give ``(query, positive, negatives)`` pairs:

- ``pairs`` files: a row is a pair;
- ``beir`` files: corpus, queries and qrels in one file; each qrel with a score above 0 is a
  pair of its query and document (the document's title, when it has one, opens its text, as
  the retrieval service embeds a chunk with its title), and the corpus is kept;
- a retrieval collection, with no labels (:func:`title_pairs`): a document's title, and each
  Markdown heading, is paired with the passage under it.

Hard negatives (:func:`mine_negatives`, the ``hard_negatives`` hyperparameter) are mined with
sentence-transformers' own ``mine_hard_negatives`` over the job's corpus: the files' corpora
plus every text of the training pairs (a collection's documents and sections, for a job that
names one).

Held-out evaluation ranks the held-out queries against a corpus: the files' own corpora
(a beir file's documents) when there are any, else every text the pairs hold (positives and
negatives, training and held-out alike), so the held-out queries compete with all of them.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, NotRequired, TypedDict

from services.trainer.data.formats import BeirDoc, BeirQrel, BeirQuery, PairRecord, Record, of_kind

PASSAGE_CHARS = 4000  # a passage is cut here: the model reads at most max_seq_length tokens of it
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


class EmbedderPair(TypedDict):
    """One pair of an embedder job, training or held out. A plain dict at run time: it is
    written to and read from JSON (the job's files, generated questions) as it is."""

    query: str
    positive: str
    negatives: NotRequired[list[str]]  # its own negatives, then those mined for it
    document_id: NotRequired[str]  # the collection document the positive comes from
    title_of: NotRequired[str]  # a title or heading pair: the document it came from
    corpus_id: NotRequired[str]  # a beir qrel's document
    query_id: NotRequired[str]  # a beir qrel's query
    _line: NotRequired[int]  # its line in the job's file (errors name it)
    _stage: NotRequired[int]  # TITLE_STAGE or LABELLED_STAGE


@dataclass
class EmbedderData:
    """A file's pairs and its own corpus (``corpus_id -> text``; empty for pairs files)."""

    pairs: list[EmbedderPair]
    corpus: dict[str, str] = field(default_factory=dict)


# An embedder pair's ``_stage``: the collection's title and heading pairs train first with
# stages "titles_first"; every other pair (labelled, generated) is LABELLED_STAGE.
TITLE_STAGE = 0
LABELLED_STAGE = 1


def doc_text(title: str, text: str) -> str:
    return f"{title}\n{text}" if title.strip() else text


def _pair(r: PairRecord) -> EmbedderPair:
    pair: EmbedderPair = {"query": r.query, "positive": r.positive, "negatives": list(r.negatives)}
    if r.document_id is not None:
        pair["document_id"] = r.document_id
    if r.title_of is not None:
        pair["title_of"] = r.title_of
    pair["_line"] = r.line
    return pair


def embedder_data(records: list[Record]) -> EmbedderData:
    """Pairs of a parsed ``pairs`` or ``beir`` file (its records, already checked)."""
    if not records or isinstance(records[0], PairRecord):
        return EmbedderData([_pair(r) for r in of_kind(records, PairRecord)])
    docs = {r.corpus_id: doc_text(r.title, r.text) for r in records if isinstance(r, BeirDoc)}
    queries = {r.query_id: r.text for r in records if isinstance(r, BeirQuery)}
    pairs: list[EmbedderPair] = [
        {
            "query": queries[r.query_id],
            "positive": docs[r.corpus_id],
            "negatives": [],
            "corpus_id": r.corpus_id,
            "query_id": r.query_id,
            "_line": r.line,
        }
        for r in records
        if isinstance(r, BeirQrel) and r.score > 0
    ]
    return EmbedderData(pairs, docs)


def title_pairs(documents: list[tuple[str, str]], ids: list[str] | None = None) -> list[EmbedderPair]:
    """Label-free pairs from ``(title, text)`` documents: the title with the document's text,
    and each Markdown heading with its section. A heading that several sections share
    ("Introduction") says nothing about any one of them, and would pair one query with
    passages that are each other's in-batch negatives: such headings are left out. With
    ``ids`` (the documents' ids), each pair says which document it came from (``title_of``):
    a held-out title then has a relevant document to be ranked against."""
    candidates: list[tuple[str, str, str | None]] = []
    for n, (title, text) in enumerate(documents):
        of = ids[n] if ids is not None else None
        if title.strip() and text.strip():
            candidates.append((title.strip(), text.strip()[:PASSAGE_CHARS], of))
        heads = list(_HEADING.finditer(text))
        for i, m in enumerate(heads):
            end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
            body = text[m.end() : end].strip()
            if body and m.group(1).strip() != title.strip():
                candidates.append((m.group(1).strip(), body[:PASSAGE_CHARS], of))
    seen: dict[str, int] = {}
    for query, _, _ in candidates:
        seen[query] = seen.get(query, 0) + 1
    pairs: list[EmbedderPair] = []
    for q, p, of in candidates:
        if seen[q] == 1 and q != p:
            pair: EmbedderPair = {"query": q, "positive": p, "negatives": []}
            if of is not None:
                pair["title_of"] = of
            pairs.append(pair)
    return pairs


def relevant_document(pair: EmbedderPair) -> str | None:
    """The collection document a held-out pair's query should find: the one its positive names
    (``doc_ref``), or the one its title or heading came from."""
    ref = doc_ref(pair) or pair.get("title_of")
    return str(ref) if ref is not None else None


def _cid(text: str) -> str:
    return "t" + hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class RetrievalSet:
    """What held-out evaluation ranks: query id -> text, corpus id -> text, query id -> relevant ids."""

    queries: dict[str, str]
    corpus: dict[str, str]
    relevant: dict[str, set[str]]


def retrieval_set(
    train: list[EmbedderPair], held_out: list[EmbedderPair], corpus: dict[str, str]
) -> RetrievalSet:
    """The held-out pairs as a retrieval task over ``corpus`` (the files' own corpora) plus the
    held-out texts, or, when there is no corpus, over every text of ``train`` and ``held_out``."""
    docs = dict(corpus)
    by_text = {text: cid for cid, text in docs.items()}

    def add(text: str) -> str:
        if text not in by_text:
            by_text[text] = _cid(text)
            docs[by_text[text]] = text
        return by_text[text]

    for rec in [*held_out, *([] if corpus else train)]:
        add(rec["positive"])
        for neg in rec.get("negatives") or []:
            add(neg)
    queries: dict[str, str] = {}
    relevant: dict[str, set[str]] = {}
    qid_of: dict[str, str] = {}
    for rec in held_out:
        qid = qid_of.setdefault(rec["query"], f"q{len(qid_of)}")
        queries[qid] = rec["query"]
        cid = rec.get("corpus_id")
        relevant.setdefault(qid, set()).add(cid if cid in docs else by_text[rec["positive"]])
    return RetrievalSet(queries, docs, relevant)


@dataclass
class MinedNegatives:
    """Pairs with their mined negatives appended, and what mining found."""

    pairs: list[EmbedderPair]
    mined: int  # negatives mine_hard_negatives found
    repeated: int  # places filled by repeating a row's mined negatives, where too few passed
    short: int  # rows left with fewer than asked (no candidate passed at all)
    widened: int = 0  # queries the second pass looked at again


def _overlaps(a: str, b: str) -> bool:
    # a section and the document holding it (a collection's title and heading pairs): the
    # one answers whatever the other does, so neither is a negative of the other's query
    return a in b or b in a


def _fits(text: str, chosen: list[str], own: list[str], positives: set[str]) -> bool:
    return text not in chosen and text not in own and not any(_overlaps(text, pos) for pos in positives)


def _mine(
    model: Any,
    pairs: list[tuple[str, str]],
    texts: list[str],
    cache: str,
    *,
    num: int,
    skip: int,
    margin: float,
    batch_size: int,
    range_max: int | None = None,
) -> dict[str, list[str]]:
    """Query -> its candidates nearest first, by sentence-transformers' ``mine_hard_negatives``
    (which never returns a positive of the query: every pair of a query counts)."""
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    mined = mine_hard_negatives(
        Dataset.from_dict({"query": [q for q, _ in pairs], "positive": [d for _, d in pairs]}),
        model,
        corpus=texts,
        range_min=skip,
        range_max=range_max,
        relative_margin=margin,
        num_negatives=num,
        sampling_strategy="top",
        output_format="triplet",  # one row per negative found: a pair short of them keeps those it has
        batch_size=batch_size,
        cache_folder=cache,  # the second pass reuses the corpus embeddings
        verbose=False,
    )
    found: dict[str, list[str]] = {}
    for q, neg in zip(mined["query"], mined["negative"], strict=True):
        have = found.setdefault(q, [])
        if neg not in have:
            have.append(neg)
    return found


def mine_negatives(
    model: Any,
    pairs: list[EmbedderPair],
    corpus: list[str],
    *,
    count: int,
    margin: float,
    skip: int,
    batch_size: int = 64,
) -> MinedNegatives:
    """``count`` negatives for each pair, mined by ``model`` (the base encoder) over
    ``corpus`` plus the pairs' own texts with sentence-transformers' ``mine_hard_negatives``:
    the nearest texts that are not a positive of the query (every pair of a query counts), none
    scoring above the positive less ``margin`` of it and none of the ``skip`` nearest (the
    likeliest unlabelled positives). A candidate that contains a positive or lies inside one is
    dropped too. A pair keeps the negatives it came with, first.

    The first pass looks among the nearest ``skip + 10 × count`` or so; a pair left short looks
    again over the whole ranking for ten times as many. One still short (a corpus with no text far enough from its
    positive) repeats the negatives it has, so the rows of a batch give as many each; one with
    none stays short (the batch then uses the fewest any row has)."""
    import tempfile

    positives: dict[str, set[str]] = {}
    for p in pairs:
        positives.setdefault(p["query"], set()).add(p["positive"])
    texts = list(
        dict.fromkeys([*corpus, *(t for p in pairs for t in (p["positive"], *p.get("negatives", [])))])
    )
    unique = list(dict.fromkeys((p["query"], p["positive"]) for p in pairs))
    want = count + 4  # candidates beyond count, for those the overlap check drops

    def pick(p: EmbedderPair, found: dict[str, list[str]]) -> list[str]:
        own = list(p.get("negatives") or [])
        chosen: list[str] = []
        for neg in found.get(p["query"], []):
            if len(chosen) < count and _fits(neg, chosen, own, positives[p["query"]]):
                chosen.append(neg)
        return chosen

    with tempfile.TemporaryDirectory(prefix="tandem-mine-") as cache:
        found = _mine(model, unique, texts, cache, num=want, skip=skip, margin=margin, batch_size=batch_size)
        short = {p["query"] for p in pairs if len(pick(p, found)) < count}
        # ten times the candidates, from the whole ranking: a document's own sections can fill
        # the top of its title query's list, and all overlap it
        wide = min(10 * want, len(texts) - skip)
        if short and wide >= 1:
            again = _mine(
                model,
                [u for u in unique if u[0] in short],
                texts,
                cache,
                num=wide,
                range_max=len(texts),
                skip=skip,
                margin=margin,
                batch_size=batch_size,
            )
            for q in short:
                found[q] = list(dict.fromkeys([*found.get(q, []), *again.get(q, [])]))
    out: list[EmbedderPair] = []
    n_mined = n_repeated = n_short = 0
    widened = len(short) if wide >= 1 else 0
    for p in pairs:
        chosen = pick(p, found)
        n_mined += len(chosen)
        if chosen and len(chosen) < count:
            n_repeated += count - len(chosen)
            chosen = [chosen[i % len(chosen)] for i in range(count)]
        n_short += len(chosen) < count
        out.append({**p, "negatives": list(p.get("negatives") or []) + chosen})
    return MinedNegatives(out, n_mined, n_repeated, n_short, widened)


def doc_ref(pair: EmbedderPair) -> str | None:
    """The collection document a pair's positive is (a usage pair's ``document_id``, a beir
    qrel's corpus id), if it names one."""
    ref = pair.get("document_id") or pair.get("corpus_id")
    return str(ref) if ref is not None else None


def ranked_negatives(
    ranked: list[tuple[str, str]], positives: set[str], positive_text: str, *, skip: int, count: int
) -> list[str]:
    """A query's hard negatives from a collection's ranking of it (``(document id, chunk text)``
    best first, as its hybrid search returned them): the documents from rank ``skip`` on (ranks
    counted over distinct documents) that are none of ``positives`` (the documents its pairs
    name) and whose chunk neither lies inside ``positive_text`` nor holds it (a pair that names
    no document), ``count`` at most, each as its best-ranked chunk."""
    best: dict[str, str] = {}
    for doc, text in ranked:
        best.setdefault(doc, text)
    out: list[str] = []
    for doc, text in list(best.items())[skip:]:
        if len(out) == count:
            break
        if doc not in positives and not _overlaps(text, positive_text):
            out.append(text)
    return out


def chunk_positives(
    model: Any, pairs: list[EmbedderPair], chunks: dict[str, list[str]], batch_size: int = 64
) -> tuple[list[EmbedderPair], int]:
    """``pairs`` with each positive that names a document of ``chunks`` (id -> the texts its
    collection indexes for it) replaced by that document's chunk nearest the query by ``model``
    (cosine), and how many were replaced. A pair naming no such document keeps its text."""
    import numpy as np

    mapped = [p for p in pairs if (ref := doc_ref(p)) is not None and chunks.get(ref)]
    if not mapped:
        return list(pairs), 0
    queries = list(dict.fromkeys(p["query"] for p in mapped))
    texts = list(dict.fromkeys(t for p in mapped for t in chunks[str(doc_ref(p))]))

    def encode(items: list[str]) -> dict[str, np.ndarray[Any, Any]]:
        vecs = model.encode(items, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True)
        return dict(zip(items, vecs, strict=True))

    q_vec, t_vec = encode(queries), encode(texts)
    out: list[EmbedderPair] = []
    for p in pairs:
        own = chunks.get(doc_ref(p) or "")
        if not own:
            out.append(p)
            continue
        scores = np.stack([t_vec[t] for t in own]) @ q_vec[p["query"]]
        out.append({**p, "positive": own[int(np.argmax(scores))]})
    return out, len(mapped)
