"""The retrieval service embedding through an inference service's /v1/embeddings
(TANDEM_RETRIEVAL_EMBEDDER_URL): two real apps over real HTTP, compared with the same model
loaded in process."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from services.common import telemetry
from services.common.config import CommonSettings
from services.common.errors import InvalidRequest, UpstreamError
from services.inference.config import InferenceSettings
from services.retrieval.config import RetrievalSettings
from services.retrieval.core.embedder import HttpEmbedder, SentenceTransformerEmbedder
from tests.conftest import auth
from tests.helpers.servers import free_port, serve_app
from tests.retrieval.test_protocols import make_tiny_cross_encoder
from tests.retrieval.test_protocols import test_embedder_conformance as check_embedder_protocol

DOCS = [
    {"id": "cats", "title": "Cats", "text": "Cats purr and chase mice around the barn. " * 6},
    {"id": "dogs", "title": "Dogs", "text": "Dogs bark at the mail carrier every morning."},
    {"id": "rivers", "title": "Rivers", "text": "The Danube flows through Vienna and Budapest. " * 5},
    {"id": "birds", "title": "Birds", "text": "Parrots can imitate human speech and whistle tunes."},
]
QUERIES = ["which animal chases mice", "a river in Vienna", "parrots whistle", "morning mail"]


def _common(home: Path, redis_url: str, roots: Path, key: str) -> CommonSettings:
    return CommonSettings(
        home=home, redis_url=redis_url, model_roots=str(roots), log_json=False, service_api_key=key
    )


@pytest.fixture()
def embedding_server(
    tmp_path: Path, redis_url: str, tiny_model_path: Path, tiny_embedder: Path, model_root: Path
) -> Iterator[str]:
    from services.inference.app import create_app

    settings = InferenceSettings(
        model=str(tiny_model_path),
        max_model_len=128,
        embedding_models=f"shared-embedder={tiny_embedder}",
        rerank_models=f"shared-reranker={make_tiny_cross_encoder(model_root / 'tiny-cross-encoder')}",
        embedding_dtype="float32",
        embedding_max_inputs=16,  # smaller than a batch of ingestion: the embedder splits requests
    )
    with serve_app(create_app(_common(tmp_path / "inference", redis_url, model_root, ""), settings)) as url:
        yield url


def _retrieval(tmp_path: Path, name: str, redis_url: str, model_root: Path, key: str, **settings: Any) -> Any:
    from services.retrieval.app import create_app

    (tmp_path / name).mkdir()
    return create_app(
        _common(tmp_path / name, redis_url, model_root, key),
        RetrievalSettings(embedding_dtype="float32", embedding_batch_size=16, **settings),
    )


def _run(url: str, key: str, model: str) -> list[list[tuple[str, str, float]]]:
    with httpx.Client(base_url=url, headers=auth(key), timeout=120) as c:
        r = c.post(
            "/v1/collections", json={"name": "kb", "chunking": {"size": 16, "overlap": 4}, "index": "flat"}
        )
        assert r.status_code == 201, r.text
        assert r.json()["embedding_model"] == model and r.json()["dimension"] == 32
        r = c.post("/v1/collections/kb/documents", json={"documents": DOCS})
        assert r.status_code == 201, r.text
        out = []
        for q in QUERIES:
            r = c.post("/v1/collections/kb/search", json={"query": q, "top_k": 8, "mode": "dense"})
            assert r.status_code == 200, r.text
            out.append([(h["document_id"], h["text"], h["score"]) for h in r.json()["results"]])
        return out


def test_retrieval_through_the_embedding_server_equals_the_local_embedder(
    tmp_path: Path,
    embedding_server: str,
    redis_url: str,
    api_key: str,
    tiny_embedder: Path,
    model_root: Path,
    tandem_env: Path,
) -> None:
    local = _retrieval(tmp_path, "local", redis_url, model_root, api_key, embedding_model=str(tiny_embedder))
    # The service key (TANDEM_SERVICE_API_KEY) is what the remote embedder presents.
    remote = _retrieval(
        tmp_path,
        "remote",
        redis_url,
        model_root,
        api_key,
        embedding_model="shared-embedder",
        embedder_url=f"{embedding_server}/v1",
    )
    with serve_app(local) as local_url, serve_app(remote) as remote_url:
        expected = _run(local_url, api_key, str(tiny_embedder))
        got = _run(remote_url, api_key, "shared-embedder")
    assert len(expected) == len(QUERIES) and all(len(hits) >= 4 for hits in expected)
    for want, have in zip(expected, got, strict=True):
        # same chunks (the server's tokenizer chunked them), same order, same scores
        assert [(d, t) for d, t, _ in have] == [(d, t) for d, t, _ in want]
        np.testing.assert_allclose([s for *_, s in have], [s for *_, s in want], atol=1e-5)


def test_http_embedder_matches_the_local_one_and_checks_its_input(
    embedding_server: str, api_key: str, tiny_embedder: Path
) -> None:
    remote = HttpEmbedder(embedding_server, api_key, "shared-embedder", batch_size=5)
    local = SentenceTransformerEmbedder(tiny_embedder, dtype="float32")
    texts = [f"document number {i} about rivers and cats" for i in range(12)] + ["word " * 600]
    assert remote.dim == local.dim == 32
    np.testing.assert_allclose(remote.embed_documents(texts), local.embed_documents(texts), atol=1e-5)
    np.testing.assert_allclose(remote.embed_query("cats"), local.embed_query("cats"), atol=1e-5)
    assert remote.token_offsets(texts[0]) == local.token_offsets(texts[0])

    with pytest.raises(InvalidRequest) as err:
        _ = HttpEmbedder(embedding_server, api_key, "no-such-model").dim
    assert err.value.param == "embedding_model"
    with pytest.raises(UpstreamError):  # a wrong key: the server's 401, reported as the upstream's
        _ = HttpEmbedder(embedding_server, "not-a-key", "shared-embedder").dim


def test_http_embedder_conformance(embedding_server: str, api_key: str) -> None:
    check_embedder_protocol(HttpEmbedder(embedding_server, api_key, "shared-embedder"))


def test_a_collection_refuses_an_embedder_of_another_dimension(
    tmp_path: Path, embedding_server: str, redis_url: str, api_key: str, model_root: Path, tandem_env: Path
) -> None:
    """A collection built through the server, reopened where its model name gives other vectors."""
    from services.common.errors import Conflict
    from services.retrieval.core.registry import CollectionManager

    settings = RetrievalSettings(embedder_url=embedding_server, embedding_model="shared-embedder")
    manager = CollectionManager(tmp_path / "home", settings, [model_root], service_api_key=api_key)
    manager.create("acme", "kb")
    manager.close_all()
    # Locally, "shared-embedder" is not a model: the 384-dimensional MiniLM stands in for the
    # server now serving another model under the same name.
    config_path = manager.path_of("acme", "kb") / "collection.json"
    config_path.write_text(config_path.read_text().replace('"shared-embedder"', '"all-MiniLM-L6-v2"'))
    local = CollectionManager(tmp_path / "home", RetrievalSettings(), [model_root])
    with pytest.raises(Conflict) as err:
        local.get("acme", "kb")
    assert err.value.param == "embedding_model" and "32" in str(err.value) and "384" in str(err.value)


def test_search_reranks_through_the_rerank_server_as_in_process(
    tmp_path: Path, embedding_server: str, api_key: str, tiny_embedder: Path, model_root: Path
) -> None:
    """TANDEM_RETRIEVAL_RERANKER_URL: the server's cross-encoder scores the candidates, as the
    same cross-encoder loaded here does."""
    from services.retrieval.core.collection import InputDocument
    from services.retrieval.core.registry import CollectionManager
    from services.retrieval.core.reranker import CrossEncoderReranker, HttpReranker

    ce = model_root / "tiny-cross-encoder"
    remote = HttpReranker(embedding_server, api_key, "shared-reranker")
    texts = ["first passage", "second passage", "first passage"]
    np.testing.assert_allclose(
        remote.score("q", texts), CrossEncoderReranker(ce).score("q", texts), atol=1e-5
    )
    assert remote.score("q", []).shape == (0,)

    docs = [InputDocument(f"d{i}", f"passage number {i} about rivers and lakes", "", {}) for i in range(15)]
    hits = {}
    for where, extra in [
        ("local", {"reranker_model": str(ce)}),
        ("remote", {"reranker_model": "shared-reranker", "reranker_url": f"{embedding_server}/v1"}),
    ]:
        settings = RetrievalSettings(
            embedding_model=str(tiny_embedder), embedding_dtype="float32", rerank_depth=20, **extra
        )
        manager = CollectionManager(tmp_path / where, settings, [model_root], service_api_key=api_key)
        manager.create("t", "c")
        col = manager.get("t", "c")
        col.ingest(docs)
        hits[where] = [(h.chunk_id, h.scores["rerank"]) for h in col.search("rivers", top_k=5, rerank=True)]
        manager.close_all()
    assert [c for c, _ in hits["remote"]] == [c for c, _ in hits["local"]]
    np.testing.assert_allclose([s for _, s in hits["remote"]], [s for _, s in hits["local"]], atol=1e-5)


def model_server() -> tuple[FastAPI, list[dict[str, str]]]:
    """A stand-in inference service over real HTTP: its model "served" answers, "missing" is not
    served (404), "broken" fails (500), "garbled" answers with no JSON; the headers it saw."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    fast = Tokenizer(WordLevel({"[UNK]": 0, "cats": 1}, unk_token="[UNK]"))
    fast.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    app = FastAPI()
    seen: list[dict[str, str]] = []

    def failure(model: str) -> Any:
        if model == "missing":
            return JSONResponse({"error": {"message": f"model {model!r} not found", "param": "model"}}, 404)
        if model == "broken":
            return JSONResponse({"error": {"message": "engine died", "type": "server_error"}}, 500)
        if model == "garbled":
            return PlainTextResponse("not json")
        return None

    @app.get("/v1/embeddings/tokenizer/{model}")
    async def tokenizer(model: str, request: Request) -> Any:
        seen.append(dict(request.headers))
        return failure(model) or {"tokenizer": fast.to_str(), "max_tokens": 16, "dimensions": 2}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        seen.append(dict(request.headers))
        texts = (await request.json())["input"]
        vectors = [np.array([i, 1], dtype="<f4") for i in range(len(texts))]
        return {
            "data": [
                {"index": i, "embedding": base64.b64encode(v.tobytes()).decode()}
                for i, v in enumerate(vectors)
            ]
        }

    @app.post("/v1/rerank")
    async def rerank(request: Request) -> Any:
        body = await request.json()
        scored = [{"index": i, "relevance_score": float(i)} for i in range(len(body["documents"]))]
        return failure(body["model"]) or {"results": scored}

    return app, seen


def test_remote_failures_name_the_setting_or_the_server(api_key: str) -> None:
    """Over the shared OpenAI client: a model the server does not serve is the setting's 400,
    anything else the named server's 502; the call carries the key and the caller's trace."""
    from services.retrieval.core.reranker import HttpReranker

    app, seen = model_server()
    with serve_app(app) as url:
        embedder = HttpEmbedder(f"{url}/v1/", api_key, "served")
        assert embedder.url == url
        provider = telemetry.make_provider("retrieval")
        token = telemetry._service_provider.set(provider)  # as a request of the service would
        try:
            with telemetry.span("ingest"):
                trace_id = telemetry.current_trace_id()
                vectors = embedder.embed_documents(["cats", "dogs", "cats dogs"])
        finally:
            telemetry._service_provider.reset(token)
        np.testing.assert_array_equal(vectors, [[0, 1], [1, 1], [2, 1]])
        assert embedder.token_offsets("cats dogs") == [(0, 4), (5, 9)]
        for headers in seen:
            assert headers["authorization"] == f"Bearer {api_key}"
            assert headers["traceparent"].split("-")[1] == trace_id  # the embedding call joins the trace

        with pytest.raises(InvalidRequest) as bad:
            _ = HttpEmbedder(url, api_key, "missing").dim
        assert (bad.value.status_code, bad.value.param) == (400, "embedding_model")
        assert bad.value.message == f"embedding_model: 'missing' is not served by the embedding server {url}"
        with pytest.raises(UpstreamError) as failed:
            _ = HttpEmbedder(url, api_key, "broken").dim
        assert failed.value.status_code == 502
        assert failed.value.message == f"embedding server {url} answered 500: engine died"
        with pytest.raises(UpstreamError, match=f"^embedding server {url}: .*no JSON"):
            _ = HttpEmbedder(url, api_key, "garbled").dim

        np.testing.assert_array_equal(HttpReranker(url, api_key, "served").score("q", ["a", "b"]), [0, 1])
        with pytest.raises(InvalidRequest) as bad:
            HttpReranker(url, api_key, "missing").score("q", ["a"])
        assert bad.value.param == "reranker_model"
        assert bad.value.message == f"reranker_model: 'missing' is not served by the rerank server {url}"
        with pytest.raises(UpstreamError, match=f"^rerank server {url} answered 500: engine died$"):
            HttpReranker(url, api_key, "broken").score("q", ["a"])

    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UpstreamError, match=f"^embedding server {gone} unreachable: ConnectError"):
        _ = HttpEmbedder(gone, api_key, "served").dim
