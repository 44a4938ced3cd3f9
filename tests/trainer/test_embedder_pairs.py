"""Where an embedder job's pairs come from (issue 17, item 1): hard negatives mined by the base
model over the job's corpus, BEIR qrels uploaded as TSV, pairs from the loop's feedback. On the
tiny random sentence-transformer of test_embedder.py."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.common.auth import KeyStore
from services.trainer.data.formats import PairRecord, of_kind, parse_dataset
from services.trainer.data.pairs import embedder_data, mine_negatives
from services.trainer.protocol import Hyperparameters, JobCreate
from services.trainer.recipes.base import NullHooks, TrainConfig, run
from services.trainer.recipes.embedder import EmbedderRecipe
from tests.conftest import auth
from tests.trainer.conftest import jsonl
from tests.trainer.test_api import Harness
from tests.trainer.test_embedder import PAIRS, TOPICS, config, harness, post_job, tiny_st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
__all__ = ["harness", "tiny_st"]  # fixtures, used here by name


def load(path: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


# ---- hard negatives
def test_mined_negatives_are_never_a_positive_of_their_query(tiny_st: Path) -> None:
    """A query with several positives, a document holding another pair's section, a pair that
    brings its own negative: every mined negative is a corpus text, none is (or holds, or lies
    in) a positive of its query, the own negative comes first, and each row gets the count."""
    pairs = [dict(p, negatives=[]) for p in PAIRS]
    # "apple number 0" has both apple passages as positives: its sibling is no negative of it
    pairs.append({"query": PAIRS[0]["query"], "positive": PAIRS[1]["positive"], "negatives": []})
    guide = "Guide to the river.\n" + PAIRS[2]["positive"]  # holds river part 0's passage
    pairs.append({"query": "the river guide", "positive": guide, "negatives": []})
    pairs.append({"query": "river part 0 alone", "positive": PAIRS[2]["positive"], "negatives": ["own"]})
    corpus = [f"An unrelated note {i} on {t}." for i, t in enumerate(TOPICS.split())]
    got = mine_negatives(load(tiny_st), pairs, corpus, count=3, margin=0.0, skip=0)
    texts = set(corpus) | {p["positive"] for p in pairs} | {"own"}
    positives: dict[str, set[str]] = {}
    for p in pairs:
        positives.setdefault(p["query"], set()).add(p["positive"])
    assert len(got.pairs) == len(pairs) and got.mined > 0 and got.short == 0
    repeats = 0
    for before, row in zip(pairs, got.pairs, strict=True):
        assert (row["query"], row["positive"]) == (before["query"], before["positive"])
        negs = row["negatives"]
        assert negs[: len(before["negatives"])] == before["negatives"]
        assert len(negs) == len(before["negatives"]) + 3, negs
        repeats += 3 - len(set(negs[len(before["negatives"]) :]))
        assert set(negs) <= texts
        for neg in negs:
            for pos in positives[row["query"]]:
                assert neg != pos and neg not in pos and pos not in neg, (row["query"], neg)
    assert repeats == got.repeated  # a row short of candidates repeats its own, and says so
    # mined, not drawn: each row's first mined negative is the text nearest its query that
    # passes the checks and scores no higher than its positives (margin 0); brute-force cosine
    # over every text is the oracle
    model = load(tiny_st)
    pool = sorted(texts)  # a pair's own negative is a corpus text for the other queries
    emb = dict(zip(pool, model.encode(pool, normalize_embeddings=True), strict=True))

    queries = sorted(positives)
    q_emb = dict(zip(queries, model.encode(queries, normalize_embeddings=True), strict=True))

    def score(query: str, text: str) -> float:
        return float(q_emb[query] @ emb[text])

    for before, row in zip(pairs, got.pairs, strict=True):
        q, own = row["query"], before["negatives"]
        floor = min(score(q, pos) for pos in positives[q])  # margin 0: never above a positive
        eligible = [t for t in pool if not any(t in pos or pos in t for pos in positives[q]) and t not in own]
        best = max(s for s in (score(q, t) for t in eligible) if s <= floor + 1e-6)
        assert score(q, row["negatives"][len(own)]) == pytest.approx(best, abs=1e-5), q
    # a margin skips every candidate scoring within that share of the positive (the random
    # encoder scores every text close: with 0.05 some rows keep none, and say so)
    wide = mine_negatives(model, pairs, corpus, count=3, margin=0.05, skip=0)
    assert wide.mined < got.mined and wide.short > 0
    close = 0
    for before, row in zip(pairs, wide.pairs, strict=True):
        floor = min(score(row["query"], pos) for pos in positives[row["query"]])
        close += sum(
            score(row["query"], n) > floor - 0.05 * abs(floor) + 1e-5
            for n in row["negatives"][len(before["negatives"]) :]
        )
    assert close == 0


def test_a_query_short_of_candidates_near_the_top_looks_down_the_whole_ranking(tiny_st: Path) -> None:
    """120 texts nearer the query than its positive (the margin drops them all) fill the first
    pass's window; the second pass finds a negative further down."""
    pairs = [
        {"query": "filler text", "positive": "Copper wiring carries current in old houses.", "negatives": []}
    ]
    fillers = [f"filler text number {i}" for i in range(120)]
    notes = [f"An unrelated note {i} on {t}." for i, t in enumerate(TOPICS.split())]
    got = mine_negatives(load(tiny_st), pairs, fillers + notes, count=1, margin=0.0, skip=0)
    assert (got.widened, got.mined, got.short) == (1, 1, 0)
    assert got.pairs[0]["negatives"][0] in notes


def test_hard_negatives_train_through_the_loss_and_resume_on_the_same_ones(
    tiny_st: Path, tmp_path: Path
) -> None:
    hooks = NullHooks()
    recipe = EmbedderRecipe(
        config(tiny_st, tmp_path, hard_negatives=2, hard_negatives_margin=0.0, max_steps=3), hooks=hooks
    )
    assert run(recipe) == "succeeded"
    assert all(len(p["negatives"]) == 2 for p in recipe.pairs)
    assert [h["negatives"] for h in hooks.history] == [2.0, 2.0, 2.0]
    assert all(h["loss"] > 0 for h in hooks.history)
    # the same job set up again (a resume) reads them back from its work folder, not mining
    # again: a negative marked there is what it trains on
    cache = tmp_path / "hard_negatives.json"
    saved = json.loads(cache.read_text())
    saved["pairs"][0]["negatives"][0] = "marked in the work folder"
    cache.write_text(json.dumps(saved))
    again = EmbedderRecipe(
        config(tiny_st, tmp_path, hard_negatives=2, hard_negatives_margin=0.0, max_steps=3), hooks=NullHooks()
    )
    again.setup()
    assert again.pairs[0]["negatives"][0] == "marked in the work folder"
    assert again.pairs[1:] == recipe.pairs[1:]
    # another setting is another mining
    other = EmbedderRecipe(
        config(tiny_st, tmp_path, hard_negatives=1, hard_negatives_margin=0.0, max_steps=3), hooks=NullHooks()
    )
    other.setup()
    assert all(len(p["negatives"]) == 1 for p in other.pairs)
    # the records themselves are untouched (a benchmark reuses them across runs)
    assert all(not p["negatives"] for p in recipe.cfg.records)
    # with the option off, no mining and the plain (anchor, positive) columns
    plain = NullHooks()
    assert run(EmbedderRecipe(config(tiny_st, None, max_steps=2), hooks=plain)) == "succeeded"
    assert [h["negatives"] for h in plain.history] == [0.0, 0.0]


def test_hard_negatives_are_embedder_hyperparameters_only() -> None:
    hp = Hyperparameters.model_validate({"hard_negatives": 4, "hard_negatives_margin": 0.1})
    assert (hp.hard_negatives, hp.hard_negatives_margin, hp.hard_negatives_skip) == (4, 0.1, 0)
    with pytest.raises(ValueError, match="hard_negatives only applies to embedder jobs"):
        JobCreate.model_validate(
            {"type": "sft", "base_model": "x", "dataset": "f", "hyperparameters": {"hard_negatives": 2}}
        )
    with pytest.raises(ValueError, match="less than or equal to 32"):
        Hyperparameters.model_validate({"hard_negatives": 33})


def test_beir_pairs_mine_over_the_files_corpus(tiny_st: Path) -> None:
    rows: list[dict[str, Any]] = [{"corpus_id": f"d{i}", "text": p["positive"]} for i, p in enumerate(PAIRS)]
    rows += [{"corpus_id": "extra", "text": "A passage on apple: the apple is discussed, part 9."}]
    rows += [{"query_id": f"q{i}", "text": p["query"]} for i, p in enumerate(PAIRS[:4])]
    rows += [{"query_id": f"q{i}", "corpus_id": f"d{i}"} for i in range(4)]
    data = embedder_data(parse_dataset(jsonl(rows)).records)
    cfg = TrainConfig(
        kind="embedder",
        model_path=tiny_st,
        records=data.pairs,
        corpus=data.corpus,
        hp=Hyperparameters.model_validate(
            {"hard_negatives": 1, "hard_negatives_margin": 0.0, "batch_size": 4}
        ),
    )
    recipe = EmbedderRecipe(cfg)
    recipe.setup()
    # the negatives come from the whole corpus, not only the four pairs' own passages
    negs = {n for p in recipe.pairs for n in p["negatives"]}
    assert negs <= set(data.corpus.values()) and negs - {p["positive"] for p in data.pairs}


# ---- BEIR's own files as one upload
def beir_files(header: bool = True) -> dict[str, tuple[str, bytes]]:
    corpus = [{"_id": f"d{i}", "title": "", "text": p["positive"]} for i, p in enumerate(PAIRS)]
    corpus[0]["title"] = "Apples"
    queries = [{"_id": f"q{i}", "text": p["query"]} for i, p in enumerate(PAIRS)]
    queries.append({"_id": "unjudged", "text": "a query no qrel names"})
    tsv = "query-id\tcorpus-id\tscore\n" if header else ""
    tsv += "".join(f"q{i}\td{i}\t1\n" for i in range(len(PAIRS))) + "q0\td1\t0\n"
    return {
        "file": ("test.tsv", tsv.encode()),
        "corpus": ("corpus.jsonl", jsonl(corpus)),
        "queries": ("queries.jsonl", jsonl(queries)),
    }


def post_files(h: Harness, key: str, parts: dict[str, tuple[str, bytes]]) -> httpx.Response:
    return httpx.post(f"{h.base}/v1/files", files=parts, headers=auth(key), timeout=60)


def test_beir_qrels_tsv_uploads_with_its_corpus_and_queries(
    harness: Harness, api_key: str, tiny_st: Path
) -> None:
    from services.trainer.paths import dataset_path

    up = post_files(harness, api_key, beir_files())
    assert up.status_code == 201, up.text
    got = up.json()
    assert got["format"] == "beir" and got["kinds"] == ["embedder"] and got["filename"] == "test.tsv"
    # every document, the queries the qrels name (not the unjudged one), every qrel
    assert got["rows"] == len(PAIRS) + len(PAIRS) + len(PAIRS) + 1
    stored = dataset_path(harness.st.common, "acme", got["id"]).read_bytes()
    data = embedder_data(parse_dataset(stored).records)
    assert [(p["query"], p["positive"]) for p in data.pairs][:2] == [
        (PAIRS[0]["query"], "Apples\n" + PAIRS[0]["positive"]),
        (PAIRS[1]["query"], PAIRS[1]["positive"]),
    ]
    assert len(data.pairs) == len(PAIRS) and len(data.corpus) == len(PAIRS)  # the score-0 qrel is no pair
    # the header line is optional
    bare = post_files(harness, api_key, beir_files(header=False))
    assert bare.status_code == 201 and bare.json()["rows"] == got["rows"]
    # and the file trains an embedder job like a beir JSONL file, here with mined negatives
    body = {
        "type": "embedder",
        "base_model": str(tiny_st),
        "dataset": got["id"],
        "eval_fraction": 0.25,
        "hyperparameters": {"hard_negatives": 2, "hard_negatives_margin": 0, "max_steps": 2, "batch_size": 4},
    }
    job = post_job(harness, api_key, body)
    assert job.status_code == 201, job.text
    assert harness.run_worker(job.json()["id"]) == "succeeded"
    done = httpx.get(f"{harness.base}/v1/jobs/{job.json()['id']}", headers=auth(api_key)).json()
    assert done["metrics"]["negatives"] == 2.0 and "eval_ndcg@10_after" in done["metrics"], done["metrics"]


@pytest.mark.parametrize(
    ("part", "content", "needle", "param"),
    [
        ("file", b"q0\td0\n", "file 'test.tsv': line 1: a qrels row has 3 tab-separated fields", "file"),
        (
            "file",
            b"query-id\tcorpus-id\tscore\nq0\td0\tone\n",
            "line 2: score 'one' is not a number",
            "file.score",
        ),
        (
            "file",
            b"q0\td0\t1\nq1\tnope\t1\n",
            "line 2: corpus-id 'nope' is not in the corpus file",
            "file.corpus-id",
        ),
        (
            "file",
            b"q0\td0\t1\nzz\td1\t1\n",
            "line 2: query-id 'zz' is not in the queries file",
            "file.query-id",
        ),
        ("file", b"q0\td0\t0\n", "no qrels row with a score above 0", "file.score"),
        (
            "corpus",
            b'{"_id": "d0", "text": "x"}\n{"_id": "d1", "text": " "}\n',
            "corpus 'corpus.jsonl': line 2: field 'text' is empty",
            "corpus.text",
        ),
        (
            "corpus",
            b'{"_id": "d0", "text": "x"}\n{"text": "y"}\n',
            "line 2: field '_id' is missing",
            "corpus._id",
        ),
        (
            "queries",
            b'{"_id": "q0", "text": "x"}\nnot json\n',
            "queries 'queries.jsonl': line 2: malformed JSON",
            "queries",
        ),
    ],
)
def test_bad_beir_rows_are_a_400_naming_the_part_and_line(
    harness: Harness, api_key: str, part: str, content: bytes, needle: str, param: str
) -> None:
    parts = beir_files()
    parts[part] = (parts[part][0], content)
    resp = post_files(harness, api_key, parts)
    assert resp.status_code == 400, resp.text
    assert needle in resp.json()["error"]["message"], resp.json()
    assert resp.json()["error"]["param"] == param


def test_a_qrels_tsv_needs_its_corpus_and_queries(harness: Harness, api_key: str) -> None:
    def files() -> int:
        return len(httpx.get(f"{harness.base}/v1/files", headers=auth(api_key)).json()["data"])

    before = files()
    for drop in (["queries"], ["corpus", "queries"]):
        parts = beir_files()
        for p in drop:
            del parts[p]
        resp = post_files(harness, api_key, parts)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == drop[0], resp.text
        assert (
            "BEIR's corpus.jsonl as 'corpus' and queries.jsonl as 'queries'"
            in resp.json()["error"]["message"]
        )
    assert files() == before


# ---- usage pairs from the loop's feedback
def test_thumbs_up_answers_become_pairs_of_question_and_cited_chunk(
    tandem_env: Path,
    tiny_st: Path,
    redis_url: str,
    api_key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real retrieval (the tiny embedder), agent and trainer over HTTP; the LLM is the agent
    tests' scripted double, which answers from its first source and cites it [1]. Thumbs-up
    answers give (question, cited chunk) pairs; a thumbs down gives none; an embedder job on the
    collection accepts them, and refuses them once a cited document is deleted."""
    from services.agent.app import create_app as agent_app
    from services.agent.config import AgentSettings
    from services.common.config import CommonSettings
    from services.retrieval.app import create_app as retrieval_app
    from services.trainer.app import create_app as trainer_app
    from services.trainer.config import TrainerSettings
    from tests.agent.doubles import ScriptedModel, cite_first, inference_double
    from tests.helpers.servers import serve_app

    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", str(tiny_st.parent))
    docs = [
        {"id": "leave", "title": "Leave policy", "text": "Staff get 30 days of paid leave a year."},
        {
            "id": "bikes",
            "title": "Bike scheme",
            "text": "The bike scheme pays up to 900 euros for a new bike.",
        },
        {"id": "lunch", "title": "Canteen", "text": "Lunch in the canteen costs four euros."},
    ]
    queued: list[str] = []
    trainer = trainer_app(CommonSettings(), TrainerSettings())
    trainer.state.trainer.dispatch = lambda job_id, queue: queued.append(job_id)
    with (
        serve_app(retrieval_app()) as r_url,
        serve_app(inference_double(ScriptedModel(replies=cite_first))) as i_url,
        serve_app(trainer) as t_url,
    ):
        trainer.state.trainer.common = trainer.state.trainer.common.model_copy(
            update={"retrieval_url": r_url}
        )
        common = CommonSettings(
            home=tandem_env / "agent-home",
            redis_url=redis_url,
            retrieval_url=r_url,
            inference_url=i_url,
            trainer_url=t_url,
            log_json=False,
        )
        with (
            serve_app(agent_app(common, AgentSettings())) as a_url,
            httpx.Client(headers=auth(api_key), timeout=60) as c,
        ):
            assert c.post(f"{r_url}/v1/collections", json={"name": "hr"}).status_code == 201
            assert c.post(f"{r_url}/v1/collections/hr/documents", json={"documents": docs}).status_code == 201
            answers = {}
            for q in (
                "How much paid leave do staff get a year?",
                "What does the bike scheme pay?",
                "Lunch price?",
            ):
                resp = c.post(
                    f"{a_url}/v1/pipelines/chat-documents/run", json={"query": q, "collection": "hr"}
                )
                assert resp.status_code == 200, resp.text
                answers[q] = resp.json()
            up = list(answers)[:2]
            for q, a in answers.items():
                rating = 1 if q in up else -1
                assert c.post(
                    f"{a_url}/v1/feedback", json={"message_id": a["message_id"], "rating": rating}
                ).is_success
            built = c.post(f"{a_url}/v1/feedback/datasets", json={"format": "pairs"})
            assert built.status_code == 200, built.text
            out = built.json()
            # the rows are each thumbs-up answer's question with the chunks its answer cites
            expected = []
            for q in up:
                for cite in c.get(f"{a_url}/v1/messages/{answers[q]['message_id']}").json()["citations"]:
                    expected.append(
                        {
                            "query": q,
                            "positive": f"{cite['title']}\n{cite['text']}",
                            "document_id": cite["document_id"],
                        }
                    )
            assert expected and out["rows"] == len(expected)
            assert out["counts"] == {"thumbs_up": 2, "pairs": len(expected)}
            stored = c.get(f"{t_url}/v1/files/{out['file_id']}").json()
            assert (stored["format"], stored["kinds"], stored["rows"]) == (
                "pairs",
                ["embedder"],
                len(expected),
            )
            from services.trainer.paths import dataset_path

            rows = parse_dataset(
                dataset_path(trainer.state.trainer.common, "acme", out["file_id"]).read_bytes()
            )
            got = of_kind(rows.records, PairRecord)
            assert [
                {"query": r.query, "positive": r.positive, "document_id": r.document_id} for r in got
            ] == expected
            # the train shortcut names an LLM job: for pairs it says where to go instead
            refused = c.post(f"{a_url}/v1/feedback/train", json={"format": "pairs"})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "format"

            job = {
                "type": "embedder",
                "base_model": str(tiny_st),
                "dataset": out["file_id"],
                "collection": "hr",
                "hyperparameters": {"hard_negatives": 1},
            }
            created = c.post(f"{t_url}/v1/jobs", json=job)
            assert created.status_code == 201, created.text
            gone = expected[0]["document_id"]
            assert c.delete(f"{r_url}/v1/collections/hr/documents/{gone}").is_success
            refused = c.post(f"{t_url}/v1/jobs", json=job)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "dataset", refused.text
            message = refused.json()["error"]["message"]
            assert (
                f"line 1: the positive's document_id {gone!r} is not a document of collection 'hr'" in message
            )
    assert queued == [created.json()["id"]]


# ---- questions the inference service writes for sampled passages
QUESTION_DOCS = [
    {"id": f"d{i}", "title": f"All about the {t}", "text": f"The {t} has many properties. " * 3}
    for i, t in enumerate(TOPICS.split()[:6])
] + [{"id": "long", "title": "", "text": "# Part one\n" + "word " * 300 + "\n# Part two\nThe end."}]


class ChatRequests:
    """An ASGI wrapper of the real inference app that notes who asked each chat completion
    ((bearer key, X-Tandem-Tenant)) and runs ``on_chat`` first: a test's hook at a known point.
    While ``refuse`` holds statuses, a request acting for a tenant (the worker's) is answered
    the next of them (Retry-After: 0) instead, as a busy or restarting service would."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str | None]] = []
        self.on_chat: Any = None
        self.refuse: list[int] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
            self.seen.append(
                (headers["authorization"].removeprefix("Bearer "), headers.get("x-tandem-tenant"))
            )
            if self.on_chat is not None:
                self.on_chat()
            if self.refuse and "x-tandem-tenant" in headers:
                status = self.refuse.pop(0)
                body = json.dumps({"error": {"message": f"refused with {status}", "type": "busy"}}).encode()
                head = [(b"content-type", b"application/json"), (b"retry-after", b"0")]
                await send({"type": "http.response.start", "status": status, "headers": head})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


@dataclass
class QuestionRig:
    h: Harness
    c: httpx.Client
    retrieval: str
    inference: ChatRequests
    operator: str
    body: dict[str, Any]  # an embedder job on collection kb and a beir file, with generate_queries
    earlier: set[str]  # the tenant's files before (the session's Valkey keeps other tests' files)


@pytest.fixture()
def rig(
    tandem_env: Path,
    tiny_st: Path,
    tiny_model_path: Path,
    api_key: str,
    key_store: KeyStore,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[QuestionRig]:
    """The real retrieval and inference services (a tiny random Llama: what it writes is noise,
    the path is what is checked) and the trainer over HTTP, its worker run in process with an
    operator key as TANDEM_SERVICE_API_KEY; collection kb holds QUESTION_DOCS."""
    from services.common.config import CommonSettings
    from services.inference.app import create_app as inference_app
    from services.inference.config import InferenceSettings
    from services.retrieval.app import create_app as retrieval_app
    from services.trainer.config import TrainerSettings
    from tests.helpers.servers import serve_app
    from tests.trainer.test_api import serving, upload

    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", str(tiny_st))
    # retrieval and inference read the roots when created (the trainer's harness sets its own)
    monkeypatch.setenv("TANDEM_MODEL_ROOTS", f"{tiny_st.parent}:{tiny_model_path.parent}")
    inference = ChatRequests(
        inference_app(CommonSettings(), InferenceSettings(model=str(tiny_model_path), max_batch_size=4))
    )
    settings = TrainerSettings(heartbeat_interval_s=0.2, stale_after_s=10.0, query_generation_concurrency=2)
    operator = key_store.create("system", operator=True)[0]
    with (
        serve_app(retrieval_app()) as r_url,
        serve_app(inference) as i_url,
        serving(tiny_st, tandem_env, monkeypatch, settings) as h,
        httpx.Client(headers=auth(api_key), timeout=120) as c,
    ):
        h.st.common = h.st.common.model_copy(
            update={"retrieval_url": r_url, "inference_url": i_url, "service_api_key": operator}
        )
        assert c.post(f"{r_url}/v1/collections", json={"name": "kb"}).status_code == 201
        added = c.post(f"{r_url}/v1/collections/kb/documents", json={"documents": QUESTION_DOCS})
        assert added.status_code == 201, added.text
        chat_model = c.get(f"{i_url}/v1/models").json()["data"][0]["id"]
        beir = [{"corpus_id": "c1", "title": "Copper", "text": "Copper conducts heat well."}]
        beir += [
            {"query_id": "q1", "text": "does copper conduct heat"},
            {"query_id": "q1", "corpus_id": "c1"},
        ]
        earlier = {f["id"] for f in c.get(f"{h.base}/v1/files").json()["data"]}
        fid = upload(h, api_key, jsonl(beir)).json()["id"]
        body = {
            "type": "embedder",
            "base_model": str(tiny_st),
            "collection": "kb",
            "dataset": fid,
            "generate_queries": {"model": chat_model, "passages": 6, "max_tokens": 12},
            # the beir file's document is not the collection's: trained as a whole document
            "positives": "documents",
            "hyperparameters": {"max_steps": 2, "batch_size": 4},
        }
        yield QuestionRig(h, c, r_url, inference, operator, body, earlier)


def kept_replies(h: Harness, job_id: str) -> dict[int, str]:
    from services.trainer.paths import job_dir
    from services.trainer.questions import load_replies, questions_dir

    return load_replies(questions_dir(job_dir(h.st.common, job_id)))


def generated_files(rig: QuestionRig) -> list[dict[str, Any]]:
    files = rig.c.get(f"{rig.h.base}/v1/files").json()["data"]
    return [f for f in files if f["filename"] == "generated-queries.jsonl" and f["id"] not in rig.earlier]


def test_generated_queries_pair_sampled_passages_with_what_a_real_inference_service_writes(
    rig: QuestionRig, api_key: str
) -> None:
    """POST /v1/jobs samples the passages (the collection's and the beir dataset's corpus), asks
    the first one's question with the caller's key and queues the job at once; the worker asks
    the rest with the operator key acting for the job's tenant, with progress events, saves the
    usable replies as a pairs file (the job's generated_dataset) and trains on them."""
    from services.trainer.data.queries import passages
    from services.trainer.paths import dataset_path

    h, c, body, asked = rig.h, rig.c, rig.body, rig.inference.seen
    gen = body["generate_queries"]
    for bad, param, status in [
        ({"generate_queries": {**gen, "model": "no-such-model"}}, "generate_queries.model", 404),
        ({"generate_queries": {**gen, "passages": 10**5}}, "generate_queries.passages", 400),
        ({"base_model": "no-such-embedder"}, "base_model", 400),
    ]:
        resp = c.post(f"{h.base}/v1/jobs", json={**body, **bad})
        assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text
    assert asked == [(api_key, None)]  # the unknown model, asked with the caller's key; nothing else
    refused = c.post(f"{h.base}/v1/jobs", json={**body, "type": "sft", "base_model": "x"})
    assert refused.status_code in (400, 422) and "generate_queries" in refused.text
    # without a service key the worker could not ask: refused now, not after the job starts
    h.st.common = h.st.common.model_copy(update={"service_api_key": ""})
    refused = c.post(f"{h.base}/v1/jobs", json=body)
    assert refused.status_code == 503 and refused.json()["error"]["param"] == "generate_queries"
    h.st.common = h.st.common.model_copy(update={"service_api_key": rig.operator})
    asked.clear()

    created = c.post(f"{h.base}/v1/jobs", json=body)
    assert created.status_code == 201, created.text
    job = created.json()
    # queued at once: one question asked (with the caller's key), none saved as a file yet
    assert (
        job["status"] == "queued" and job["generated_dataset"] is None and job["dataset"] == body["dataset"]
    )
    assert h.dispatched[-1][0] == job["id"]
    assert asked == [(api_key, None)] and not generated_files(rig)
    assert list(kept_replies(h, job["id"])) == [0]

    rig.inference.refuse = [429, 503]  # a busy, then a restarting service: asked again
    assert h.run_worker(job["id"]) == "succeeded"
    # the other five passages (two asked twice), by the worker as the operator acting for acme
    assert asked[1:] == [(rig.operator, "acme")] * 7 and not rig.inference.refuse
    assert sorted(kept_replies(h, job["id"])) == list(range(6))
    done = c.get(f"{h.base}/v1/jobs/{job['id']}").json()
    assert done["progress"]["step"] == 2 and done["status"] == "succeeded"
    (made,) = generated_files(rig)
    assert made["format"] == "pairs" and 2 <= made["rows"] <= 6
    assert done["generated_dataset"] == made["id"] and done["dataset"] == body["dataset"]
    # the question phase's progress, as the job's events tell it (the batches of 2)
    events = c.get(f"{h.base}/v1/jobs/{job['id']}/events").text
    phase = [
        json.loads(block.split("data: ", 1)[1])
        for block in events.split("\n\n")
        if "event: progress" in block and '"phase"' in block
    ]
    assert [(e["phase"], e["step"], e["total"]) for e in phase] == [
        ("generate_queries", n, 6) for n in (3, 5, 6)
    ]
    rows = of_kind(
        parse_dataset(dataset_path(h.st.common, "acme", made["id"]).read_bytes()).records, PairRecord
    )
    # every positive is a passage of the collection (with its document) or of the beir corpus
    pool = passages([(d["id"], d["title"], d["text"]) for d in QUESTION_DOCS])
    by_text = {p.text: p.document for p in pool}
    corpus_passages = {p.text for p in passages([("c1", "", "Copper\nCopper conducts heat well.")])}
    for r in rows:
        assert r.query.strip() and len(r.query) <= 300
        assert r.positive in by_text or r.positive in corpus_passages, r.positive
        assert r.document_id == by_text.get(r.positive)
    # the long document's sections are passages of their own, as the retrieval service cuts them
    assert sum(p.document == "long" for p in pool) >= 3

    # a collection with no titles or headings: no label-free pairs of its own, but the
    # questions train it (their file, named from the start, is the job's dataset)
    plain = [
        {"id": f"p{i}", "text": f"Plain note {i} about the {t}."} for i, t in enumerate(TOPICS.split()[:5])
    ]
    assert c.post(f"{rig.retrieval}/v1/collections", json={"name": "plain"}).status_code == 201
    assert (
        c.post(f"{rig.retrieval}/v1/collections/plain/documents", json={"documents": plain}).status_code
        == 201
    )
    alone = {k: v for k, v in body.items() if k != "dataset"} | {"collection": "plain"}
    without = c.post(f"{h.base}/v1/jobs", json={k: v for k, v in alone.items() if k != "generate_queries"})
    assert without.status_code == 400 and without.json()["error"]["param"] == "collection", without.text
    created = c.post(f"{h.base}/v1/jobs", json=alone)
    assert created.status_code == 201, created.text
    assert created.json()["generated_dataset"] is None
    assert h.run_worker(created.json()["id"]) == "succeeded"
    done = c.get(f"{h.base}/v1/jobs/{created.json()['id']}").json()
    assert done["dataset"] == done["generated_dataset"] == created.json()["dataset"]


def test_question_phase_stops_on_cancel_and_resumes_without_asking_again(
    rig: QuestionRig, api_key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancel, requested while the worker's first batch of questions is being answered, stops
    the job before the next batch; a worker that loses the job after its first batch (as one
    killed would) leaves those replies kept, and the job resumed asks only for the rest."""
    from services.trainer.hooks import JobHooks, LeaseLost

    h, c, asked = rig.h, rig.c, rig.inference.seen
    created = c.post(f"{h.base}/v1/jobs", json=rig.body)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]

    def cancel_on_the_workers_first_question() -> None:
        if asked[-1][1] == "acme" and asked.count(asked[-1]) == 1:
            assert h.st.store.request_cancel("acme", job_id).cancel_requested

    rig.inference.on_chat = cancel_on_the_workers_first_question
    assert h.run_worker(job_id) == "cancelled"
    rig.inference.on_chat = None
    # the batch in flight (2 questions) finished and was kept; no further batch was asked
    assert asked[1:] == [(rig.operator, "acme")] * 2
    assert sorted(kept_replies(h, job_id)) == [0, 1, 2]
    job = c.get(f"{h.base}/v1/jobs/{job_id}").json()
    assert job["status"] == "cancelled" and job["generated_dataset"] is None
    assert not generated_files(rig)

    # a worker lost after its first batch; the job resumed asks for the passages not kept
    asked.clear()
    created = c.post(f"{h.base}/v1/jobs", json=rig.body)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    real = JobHooks.should_stop
    checks = iter(range(1000))

    def lost_before_the_second_batch(self: JobHooks) -> bool:
        if next(checks) == 1:
            raise LeaseLost(self.job_id)
        return real(self)

    monkeypatch.setattr(JobHooks, "should_stop", lost_before_the_second_batch)
    assert h.run_worker(job_id) == "lease-lost"
    assert len(asked) == 3 and sorted(kept_replies(h, job_id)) == [0, 1, 2]
    assert c.get(f"{h.base}/v1/jobs/{job_id}").json()["status"] == "running"
    assert h.run_worker(job_id) == "succeeded"
    # passages 3, 4 and 5 only: nothing answered before is asked again
    assert asked[3:] == [(rig.operator, "acme")] * 3
    assert sorted(kept_replies(h, job_id)) == list(range(6))
    done = c.get(f"{h.base}/v1/jobs/{job_id}").json()
    assert done["attempts"] == 2 and done["generated_dataset"] == generated_files(rig)[0]["id"]

    # a service that stays unavailable past the retries (4 each) fails the job, saying why
    created = c.post(f"{h.base}/v1/jobs", json=rig.body)
    assert created.status_code == 201, created.text
    rig.inference.refuse = [503] * 10  # the first batch's two questions, five tries each
    assert h.run_worker(created.json()["id"]) == "failed"
    failed = c.get(f"{h.base}/v1/jobs/{created.json()['id']}").json()
    assert not rig.inference.refuse and "inference: refused with 503" in failed["error"], failed["error"]


def test_a_reply_gives_its_first_line_as_the_question_or_nothing() -> None:
    from services.trainer.data.queries import query_of

    passage = "Cats sleep sixteen hours a day, more than most other animals of their size do."
    assert query_of('Question: "How long do cats sleep?"\nBecause...', passage) == "How long do cats sleep?"
    assert query_of("\n\n1. Query: cats sleep hours", passage) == "cats sleep hours"
    assert query_of("cats sleep", passage) == "cats sleep"  # a few of its words: a keyword query
    assert query_of(passage, passage) is None  # a copied sentence
    assert query_of("   \n ", passage) is None
    assert query_of("why " * 100, passage) is None
    # a preamble line is skipped (the question may follow it); a bare preamble or a summary is none
    assert query_of("A person might type:\nHow long do cats sleep?", passage) == "How long do cats sleep?"
    assert query_of("Passage:", passage) is None
    assert query_of("This study investigates the sleep of cats.", passage) is None
    assert query_of("The passage says cats sleep a lot", passage) is None


def test_a_question_asked_twice_is_kept_once() -> None:
    from services.trainer.data.queries import Passage, questions

    picked = [Passage("a", "Cats sleep."), Passage("b", "Dogs bark."), Passage("c", "Owls hoot.")]
    kept = questions(picked, ["How long do cats sleep?", "how long do cats sleep?", "Why do owls hoot?"])
    assert [(p.document, q) for p, q in kept] == [
        ("a", "How long do cats sleep?"),
        ("c", "Why do owls hoot?"),
    ]
