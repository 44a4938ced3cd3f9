"""ONNX Runtime embedding backends (``embedding_backend`` "onnx" / "onnx-int8") over real HTTP
with the real MiniLM: vectors against torch's, ingestion and search, the recorded backend, an
unknown backend, the torch fallback without onnxruntime, and the export cache."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from services.retrieval.core import embedder as embedder_mod
from services.retrieval.core import onnx_export
from tests.conftest import TEST_CACHE

DOCS = [
    {"id": "cats", "title": "Cats", "text": "Cats purr and chase mice around the barn."},
    {"id": "dogs", "title": "Dogs", "text": "Dogs bark at the mail carrier every morning."},
    {"id": "birds", "title": "Birds", "text": "Parrots can imitate human speech and whistle tunes."},
    {"id": "ships", "title": "Ships", "text": "Container ships carry goods across the Pacific ocean."},
]
TEXTS = [d["text"] for d in DOCS] + ["which animal barks at the postman?", "an empty string follows", ""]


@pytest.fixture(scope="session")
def onnx_exports() -> Path:
    """MiniLM's exports, made once and kept across runs (.cache is git-ignored): an export takes
    15-30 s here, and every test's home links to this folder."""
    root = TEST_CACHE / "onnx-exports"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture()
def minilm_env(retrieval_env: Path, onnx_exports: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (retrieval_env / "models").mkdir(exist_ok=True)
    (retrieval_env / "models" / "onnx").symlink_to(onnx_exports)
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_MODEL", "all-MiniLM-L6-v2")
    # torch in float32, the reference the ONNX export must reproduce.
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_DTYPE", "float32")
    return retrieval_env


def make(client: httpx.Client, name: str, backend: str | None) -> dict:
    body: dict[str, object] = {"name": name}
    if backend is not None:
        body["embedding_backend"] = backend
    r = client.post("/v1/collections", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def manager(client: httpx.Client):  # type: ignore[no-untyped-def]
    from tests.retrieval.conftest import SERVED

    return SERVED[str(client.base_url).rstrip("/")].state.collections  # type: ignore[attr-defined]


def top_ids(client: httpx.Client, name: str, query: str) -> list[str]:
    r = client.post(f"/v1/collections/{name}/search", json={"query": query, "mode": "dense", "top_k": 4})
    assert r.status_code == 200, r.text
    return [h["document_id"] for h in r.json()["results"]]


def test_onnx_and_int8_collections_ingest_search_and_match_torch(
    minilm_env: Path, client: httpx.Client
) -> None:
    for name, backend in (("t", None), ("o", "onnx"), ("q", "onnx-int8")):
        info = make(client, name, backend)
        assert info["embedding_backend"] == (backend or "torch")
        r = client.post(f"/v1/collections/{name}/documents", json={"documents": DOCS})
        assert r.status_code == 201, r.text
        assert r.json()["chunks_added"] == len(DOCS)
        assert client.get(f"/v1/collections/{name}").json()["embedding_backend"] == (backend or "torch")
        assert top_ids(client, name, "which animal barks at the postman?")[0] == "dogs"
        assert top_ids(client, name, "freight vessels at sea")[0] == "ships"

    cols = {n: manager(client).get("acme", n) for n in ("t", "o", "q")}
    assert [c.embedder.backend for c in cols.values()] == ["torch", "onnx", "onnx-int8"]
    ref = cols["t"].embedder.embed_documents(TEXTS)
    onnx = cols["o"].embedder.embed_documents(TEXTS)
    int8 = cols["q"].embedder.embed_documents(TEXTS)
    for vecs in (onnx, int8):
        assert vecs.shape == ref.shape and vecs.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert (onnx * ref).sum(1).min() > 0.9999
    # int8 is close but not equal: it embeds its own collection's documents *and* queries.
    cos8 = (int8 * ref).sum(1)
    assert cos8.min() > 0.95 and cos8.max() < 0.99999
    # A text's vector does not depend on its batch-mates (int8 activations are scaled per run):
    # a query equals the same text embedded as a document.
    for name, vecs in (("o", onnx), ("q", int8)):
        alone = np.stack([cols[name].embedder.embed_query(t) for t in TEXTS])
        np.testing.assert_allclose(alone, vecs, atol=1e-5)


def test_unknown_backend_is_a_400_naming_it(minilm_env: Path, client: httpx.Client) -> None:
    r = client.post("/v1/collections", json={"name": "x", "embedding_backend": "tensorrt"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "embedding_backend"
    assert "tensorrt" in err["message"]
    assert client.get("/v1/collections/x").status_code == 404


def test_default_backend_comes_from_the_setting(
    minilm_env: Path, monkeypatch: pytest.MonkeyPatch, client: httpx.Client
) -> None:
    monkeypatch.setenv("TANDEM_RETRIEVAL_EMBEDDING_BACKEND", "onnx")
    from services.retrieval.config import RetrievalSettings

    manager(client).settings = RetrievalSettings()
    assert make(client, "d", None)["embedding_backend"] == "onnx"
    assert make(client, "e", "torch")["embedding_backend"] == "torch"


def test_without_onnxruntime_a_collection_warns_and_uses_torch(
    retrieval_env: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    client: httpx.Client,
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError
    with caplog.at_level(logging.WARNING, logger="tandem.retrieval"):
        info = make(client, "f", "onnx-int8")
    # The collection records what embedded it, so its queries keep using torch.
    assert info["embedding_backend"] == "torch"
    assert any("'onnx-int8' unavailable" in r.getMessage() for r in caplog.records)
    r = client.post("/v1/collections/f/documents", json={"documents": DOCS})
    assert r.status_code == 201, r.text
    assert manager(client).get("acme", "f").embedder.backend == "torch"


def test_export_is_cached_whole_and_reused(
    tiny_embedder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(tiny_embedder, model)
    cache = tmp_path / "onnx"
    monkeypatch.setattr(embedder_mod, "_cache", {})
    before = onnx_export.exports_made
    first = embedder_mod.get_embedder(model, backend="onnx-int8", cache_root=cache)
    assert onnx_export.exports_made == before + 2  # fp32, then int8 from it
    folder = onnx_export.export_dir(model, cache)
    assert sorted(p.name for p in folder.iterdir()) == ["export.json", "model.onnx", "model_int8-pc.onnx"]
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    # A new process (an empty embedder cache) loads the files: nothing exported again.
    monkeypatch.setattr(embedder_mod, "_cache", {})
    again = embedder_mod.get_embedder(model, backend="onnx-int8", cache_root=cache)
    fp32 = embedder_mod.get_embedder(model, backend="onnx", cache_root=cache)
    assert again is not first and onnx_export.exports_made == before + 2
    assert {p.name: p.stat().st_mtime_ns for p in folder.glob("*.onnx")} == {
        k: v for k, v in stamps.items() if k.endswith(".onnx")
    }
    np.testing.assert_allclose(again.embed_documents(TEXTS), first.embed_documents(TEXTS), atol=1e-6)
    assert fp32.backend == "onnx" and again.backend == "onnx-int8"

    # Changed model files are another model: a new export, the old one left alone.
    (model / "config_sentence_transformers.json").touch()
    assert onnx_export.export_dir(model, cache) != folder
    monkeypatch.setattr(embedder_mod, "_cache", {})
    embedder_mod.get_embedder(model, backend="onnx", cache_root=cache)
    assert onnx_export.exports_made == before + 3
    assert not list(cache.rglob("*.tmp"))


def test_onnx_backend_with_a_remote_embedder_is_a_400(tmp_path: Path) -> None:
    from services.common.errors import InvalidRequest
    from services.retrieval.config import RetrievalSettings
    from services.retrieval.core.registry import CollectionManager

    settings = RetrievalSettings(embedder_url="http://127.0.0.1:9")  # type: ignore[call-arg]
    manager = CollectionManager(tmp_path, settings, [])
    with pytest.raises(InvalidRequest) as err:
        manager.create("acme", "r", embedding_backend="onnx")  # refused before the server is asked
    assert err.value.param == "embedding_backend" and "'onnx'" in str(err.value)
    manager.close_all()


def test_every_index_version_of_a_collection_runs_on_its_backend(
    minilm_env: Path, client: httpx.Client
) -> None:
    # a reindex (PATCH embedder) or a rollback embeds with the collection's backend: an int8
    # collection's new version must not be embedded by torch while its config says onnx-int8
    make(client, "q", "onnx-int8")
    mgr, tenant = manager(client), "acme"  # the api_key fixture's tenant
    col = mgr.get(tenant, "q")
    assert col.embedder.backend == "onnx-int8"
    assert col.embedders(col.versions().active).backend == "onnx-int8"
    emb, _ = mgr.resolve_embedder(tenant, "all-MiniLM-L6-v2", "onnx-int8")
    assert emb.backend == "onnx-int8"
